"""Hooks into training frameworks; each module imports its framework only when used.

- `offload.integrations.transformers`: `OffloadTrainerMixin` for Hugging Face `Trainer`
  (and its subclasses); plain accelerate loops need nothing but `offload.activations()`.
- `offload.integrations.lightning`: `OffloadCallback` for a Lightning `Trainer`.
"""
