"""A stand-in for the SGLang interpreter (SGLANG_PYTHON, SGLang 0.5.3.post3 and sglang-router 0.2.0):
``-m sglang.launch_server ARGS`` runs the repository's mock server (megatron_zcpo.testing.mock_server,
the embedded engine on the Hugging Face checkpoint of --model-path) with the same arguments, ``-m
sglang_router.launch_router ARGS`` the mock router; anything else runs as this Python."""

import os
import sys

STAND_INS = {
    "sglang.launch_server": "megatron_zcpo.testing.mock_server",
    "sglang_router.launch_router": "megatron_zcpo.testing.mock_router",
}

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["-m"] and argv[1] in STAND_INS:
        argv = ["-m", STAND_INS[argv[1]], *argv[2:]]
    os.execv(sys.executable, [sys.executable, *argv])
