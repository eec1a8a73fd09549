"""What the server tests share: a checkpoint with a chat template, `offload serve` started
as a command on a free port, and plain HTTP (for what a client library would not send)."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import zoo

KEY = "test-key"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def http(url, body: bytes | None = None, headers=None) -> tuple[int, str]:
    """Status and text of a GET (or a POST of `body`), errors included."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chat_checkpoint(folder):
    path = zoo.save_attentive_llm(folder)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


class Server:
    def __init__(self, path, *flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "offload.cli", "serve", str(path), "--port",
                   str(self.port), "--served-model-name", "tiny", *flags]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(self.process.stderr.read().decode())
            try:
                if http(self.url + "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    def client(self, key=KEY):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


class InProcess:
    """`offload serve`'s app over `llm`, on uvicorn in a thread of this process."""

    def __init__(self, llm, **settings):
        import uvicorn

        from offload.server.app import ServeSettings, make_app

        self.url = f"http://127.0.0.1:{free_port()}"
        app = make_app(llm, ServeSettings("tiny", **settings))
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
