// This process's forks, as its fork handler counts them: process.py's (through hooks.py)
// calls `_C.after_fork_in_child` in each child, which bumps it. What was made in an earlier
// generation belongs to the parent: a packer (hook_front.cpp) hands its saves to the Python
// path, an I/O request (io_request.hpp) is not waited for. A plain integer: in a process
// it changes only in its forked child, before any other thread runs there.
#pragma once

namespace offload {

inline long long fork_generation = 0;

}  // namespace offload
