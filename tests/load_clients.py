"""The clients of the server's load test, run as their own process (so that the test
process's memory is the server's alone):

    python tests/load_clients.py URL CLIENTS REQUESTS SEED EXPECTED_JSON

Each of CLIENTS threads sends REQUESTS requests of random kinds; prints one JSON list
of [kind, as expected] per request."""

from __future__ import annotations

import json
import random
import ssl
import sys
import threading

import openai
from http_server import http

PROMPTS = [f"t{i} t{i + 2} t{3 * i}" for i in range(3, 11)]
MAX_TOKENS = 8
# (one for every client: each client's own loads the system's certificates, 25 ms of CPU
# for a connection over plain HTTP; 320 of them took a share of the suite's time)
_TLS = ssl.create_default_context()


def _client(url):
    http_client = openai.DefaultHttpxClient(verify=_TLS)
    return openai.OpenAI(
        base_url=url + "/v1", api_key="x", max_retries=0, timeout=120, http_client=http_client
    )


def _one(url, expected, rng, outcomes):
    """One request of a random kind; what happened is appended to `outcomes`."""
    kind = rng.choices(["answer", "stream", "leave", "malformed", "too-long"], [5, 3, 1, 1, 1])[0]
    index = rng.randrange(len(PROMPTS))
    client = _client(url)
    try:
        if kind == "malformed":
            status, _ = http(
                url + "/v1/completions", b'{"prompt": ', {"Content-Type": "application/json"}
            )
            outcomes.append(("malformed", status == 400))
        elif kind == "too-long":
            try:
                client.completions.create(model="tiny", prompt=[5] * 5000, max_tokens=1)
                outcomes.append(("too-long", False))
            except openai.BadRequestError:
                outcomes.append(("too-long", True))
        elif kind == "leave":
            stream = client.completions.create(
                model="tiny", prompt=PROMPTS[index], max_tokens=200, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            next(iter(stream))
            stream.close()
            outcomes.append(("leave", True))
        else:
            params = {"model": "tiny", "prompt": PROMPTS[index], "max_tokens": MAX_TOKENS,
                      "temperature": 0, "extra_body": {"ignore_eos": True}}  # fmt: skip
            if kind == "stream":
                text = "".join(
                    c.choices[0].text for c in client.completions.create(stream=True, **params)
                )
            else:
                text = client.completions.create(**params).choices[0].text
            outcomes.append((kind, text == expected[index]))
    except openai.APIError as error:  # a request that met the disk fault: a clear 500
        failed = getattr(error, "status_code", 500) == 500 or "failed" in str(error)
        outcomes.append(("fault", failed and "Input/output" in str(error)))


def main() -> None:
    url, clients, requests, seed, expected = sys.argv[1:6]
    expected = json.loads(expected)
    outcomes: list = []
    master = random.Random(int(seed))

    def loop(local):
        for _ in range(int(requests)):
            _one(url, expected, local, outcomes)

    threads = [
        threading.Thread(target=loop, args=(random.Random(master.random()),))
        for _ in range(int(clients))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
