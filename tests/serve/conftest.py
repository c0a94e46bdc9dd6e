"""A tiny served model: a CMF file with a byte tokenizer, a chat template and an
MTP draft, and `cortiq serve` on it in a subprocess on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serve_helpers import arch, random_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EOS = 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_model(path: Path) -> Path:
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    m = random_model(arch("llama"), seed=5, mix=0.5)
    doc = new_doc(m.arch, tokenizer_doc(byte_tokenizer_json(), [EOS], chat_template=CHATML))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))


class Server:
    """`cortiq serve` in a subprocess; `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, model: Path, log: Path, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = log
        self._err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cortiq", "serve", str(model), "--port", "0",
                                      "--device", "cpu", *args], stdout=subprocess.DEVNULL, stderr=self._err,
                                     env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while True:
            text = log.read_text()
            if "listening on " in text:
                self.url = text.split("listening on ", 1)[1].split()[0]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"cortiq serve did not start:\n{text}")
            time.sleep(0.1)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._err.close()


@pytest.fixture(scope="module")
def served_model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("serve") / "tiny.cmf")
