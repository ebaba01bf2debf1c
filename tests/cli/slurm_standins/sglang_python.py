"""A stand-in for the SGLang interpreter (SGLANG_PYTHON, SGLang 0.5.3.post3 and sglang-router 0.2.0):
``-m sglang.launch_server ARGS`` runs the repository's mock server (megatron_zcpo.testing.mock_server,
the embedded engine on the Hugging Face checkpoint of --model-path) with the same arguments, ``-m
sglang_router.launch_router ARGS`` the mock router, also after ``-c CODE`` (sglang_node.py runs them
through code that blocks Slurm's stop signals first); anything else runs as this Python."""

import os
import sys

STAND_INS = {
    "sglang.launch_server": "megatron_zcpo.testing.mock_server",
    "sglang_router.launch_router": "megatron_zcpo.testing.mock_router",
}

if __name__ == "__main__":
    argv = sys.argv[1:]
    start = 2 if argv[:1] == ["-c"] else 0
    if argv[start : start + 1] == ["-m"] and argv[start + 1] in STAND_INS:
        argv[start + 1] = STAND_INS[argv[start + 1]]
    os.execv(sys.executable, [sys.executable, *argv])
