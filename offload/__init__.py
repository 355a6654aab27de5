"""offload: move the activations autograd saves to host RAM and NVMe, and bring them back.

    import offload
    with offload.activations():            # settings from OFFLOAD_* environment variables
        loss = model(batch)
        loss.backward()

Public names: `activations`, `no_offload`, `empty_cache`, `ActivationOffload`, `Config`, `Stats`, the error
classes, `env_table_markdown` (the README's table of environment variables), `build_info`
(what was built and whether the GPU paths can run) and `__version__`. The compiled core
`offload._C` is optional at import time (see offload/_ext.py).
"""

from ._version import __version__
from ._build_info import build_info
from .config import Config, env_table_markdown
from .context import ActivationOffload, activations, empty_cache, no_offload
from .errors import (ConfigError, ExtensionUnavailable, OffloadError, StorageError,
                     TierFullError, UsedAfterCloseError)
from .tiers.cuda_backend import GraphCaptureError
from .util.stats import Stats
from . import process as _process  # registers the at-fork handler (NOTE [Process state])

__all__ = ["activations", "no_offload", "empty_cache", "ActivationOffload", "Config", "Stats",
           "env_table_markdown", "build_info", "__version__", "OffloadError", "ConfigError", "StorageError",
           "ExtensionUnavailable", "TierFullError", "UsedAfterCloseError", "GraphCaptureError"]
