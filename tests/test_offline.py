"""headwise keeps the Hugging Face libraries offline, and loading and running a model
contacts no address but loopback."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _env(**preset: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY")}
    return env | preset


@pytest.mark.parametrize("preset, expected", [(None, "True True"), ("0", "False True")])
def test_import_turns_the_hub_off(preset, expected):
    env = _env() if preset is None else _env(HF_HUB_OFFLINE=preset)
    got = _run("""
        import headwise
        import huggingface_hub.constants as c
        print(c.HF_HUB_OFFLINE, c.HF_HUB_DISABLE_TELEMETRY)
    """, env)
    assert got == expected  # unset: offline; a user's HF_HUB_OFFLINE=0 is kept


def test_loading_and_generating_contact_only_loopback(tiny_models):
    # Every connect and name lookup that is not loopback raises, and is recorded, so a
    # library that caught the error and went on would still fail the test.
    got = _run(f"""
        import socket
        tried = []
        LOOPBACK = ("127.0.0.1", "::1", "localhost")

        def guard(host):
            if host and host not in LOOPBACK:
                tried.append(host)
                raise OSError(f"network contact to {{host!r}}")

        real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

        def connect(self, addr):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                guard(addr[0])
            return real_connect(self, addr)

        def getaddrinfo(host, *a, **k):
            guard(host.decode() if isinstance(host, bytes) else host)
            return real_getaddrinfo(host, *a, **k)

        socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
        from headwise import LLM, SamplingParams
        llm = LLM({str(tiny_models["llama"])!r}, dtype="float32", kv_cache_memory=1 << 26)
        out = llm.generate(["hello there"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
        print(len(out.token_ids), tried)
    """, _env())
    assert got == "3 []"
