"""Structured outputs on 30 JSON schemas written as users write them (strings and most
integers unbounded; nested objects, arrays, enums, patterns, a date format, bounds), none of
them the test suite's: how many answers parse and validate (`jsonschema`, with formats),
greedy and sampled, on the default model through `LLM.chat`; each failure's finish reason
and start. A schema xgrammar cannot enforce (`engine/schema_limits.py`) is counted as
refused: its request is a one-line error, not an answer.

This measures answers, not speed. Run: `python benchmarks/structured_schemas.py
[--max-tokens N]`; results JSON in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch
from common import save

from offload import LLM, ConfigError, SamplingParams, StructuredOutputsParams


# fmt: off
def _str():
    return {"type": "string"}


def _int(**more):
    return {"type": "integer", **more}


def _num(**more):
    return {"type": "number", **more}


def _obj(properties, required=None, **more):
    required = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": required, **more}


def _arr(items, **more):
    return {"type": "array", "items": items, **more}


BOOL = {"type": "boolean"}
CASES = [
 ("Describe a person as JSON.", _obj({"name": _str(), "age": _int(minimum=0, maximum=150)})),
 ("Give a product as JSON.", _obj({"id": _int(minimum=1), "title": _str(), "price": _num(minimum=0), "in_stock": BOOL})),
 ("Give the weather in Paris as JSON.", _obj({"city": _str(), "temp_c": _num(minimum=-80, maximum=60), "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
 ("List three fruits as JSON.", _obj({"fruits": _arr(_str(), minItems=3, maxItems=3)})),
 ("Give a book with its author as JSON.", _obj({"title": _str(), "author": _obj({"first": _str(), "last": _str()}), "year": _int(minimum=1000, maximum=2100)})),
 ("Give an address as JSON.", _obj({"street": _str(), "city": _str(), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": _str()}, ["street", "city", "country"])),
 ("Rate a movie as JSON.", _obj({"movie": _str(), "stars": _int(minimum=1, maximum=5), "review": _str()})),
 ("Give an order with items as JSON.", _obj({"order_id": _int(), "items": _arr(_obj({"sku": _str(), "qty": _int(minimum=1, maximum=100)}), minItems=1, maxItems=4), "total": _num(minimum=0)})),
 ("Is the sky blue? Answer as JSON.", _obj({"answer": BOOL, "confidence": _num(minimum=0, maximum=1)})),
 ("Classify the sentiment of 'I love this!' as JSON.", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "score": _num(minimum=-1, maximum=1)})),
 ("Give a user profile as JSON.", _obj({"username": _str(), "email": _str(), "roles": _arr({"enum": ["admin", "editor", "viewer"]}, minItems=1, uniqueItems=True)})),
 ("Give a 2x2 matrix as JSON.", _obj({"rows": _arr(_arr(_num(), minItems=2, maxItems=2), minItems=2, maxItems=2)})),
 ("Give an event as JSON.", _obj({"name": _str(), "date": {"type": "string", "format": "date"}, "attendees": _int(minimum=0)})),
 ("Give a color as JSON.", _obj({"name": _str(), "rgb": _arr(_int(minimum=0, maximum=255), minItems=3, maxItems=3)})),
 ("Give a recipe as JSON.", _obj({"dish": _str(), "ingredients": _arr(_str(), minItems=2, maxItems=5), "minutes": _int(minimum=1, maximum=600)})),
 ("Give a car as JSON.", _obj({"make": _str(), "model": _str(), "year": _int(minimum=1950, maximum=2030), "electric": BOOL})),
 ("Give a team with members as JSON.", _obj({"team": _str(), "members": _arr(_obj({"name": _str(), "role": {"enum": ["lead", "dev", "qa"]}}), minItems=1, maxItems=3)})),
 ("Give a point in 3D as JSON.", _obj({"x": _num(), "y": _num(), "z": _num()})),
 ("Give a student's grades as JSON.", _obj({"student": _str(), "grades": _arr(_int(minimum=0, maximum=100), minItems=1, maxItems=5), "passed": BOOL})),
 ("Give a server config as JSON.", _obj({"host": _str(), "port": _int(minimum=1, maximum=65535), "tls": BOOL, "mode": {"enum": ["dev", "prod"]}}, additionalProperties=False)),
 ("Give a tree node as JSON.", _obj({"value": _int(), "children": _arr(_obj({"value": _int()}), maxItems=2)})),
 ("Give a country as JSON.", _obj({"name": _str(), "capital": _str(), "population": _int(minimum=0), "languages": _arr(_str(), minItems=1, maxItems=3)})),
 ("Give a task as JSON.", _obj({"title": _str(), "done": BOOL, "priority": {"enum": ["low", "medium", "high"]}, "tags": _arr(_str(), maxItems=3)}, ["title", "done"])),
 ("Give a transaction as JSON.", _obj({"from": _str(), "to": _str(), "amount": _num(exclusiveMinimum=0, maximum=10000), "currency": {"enum": ["USD", "EUR", "GBP"]}})),
 ("Give an animal as JSON.", _obj({"species": _str(), "legs": _int(minimum=0, maximum=8), "can_fly": BOOL, "habitat": {"anyOf": [_str(), {"type": "null"}]}})),
 ("Give a song as JSON.", _obj({"title": _str(), "artist": _str(), "seconds": _int(minimum=30, maximum=900), "genre": {"type": ["string", "null"]}})),
 ("Give a polygon as JSON.", _obj({"vertices": _arr(_obj({"x": _num(minimum=-100, maximum=100), "y": _num(minimum=-100, maximum=100)}), minItems=3, maxItems=5)})),
 ("Give a company as JSON.", _obj({"name": _str(), "founded": _int(minimum=1800, maximum=2026), "ceo": _obj({"name": _str(), "age": _int(minimum=18, maximum=100)}), "public": BOOL})),
 ("Give a time of day as JSON.", _obj({"hour": _int(minimum=0, maximum=23), "minute": _int(minimum=0, maximum=59), "ampm": {"enum": ["am", "pm"]}})),
 ("Give a flight as JSON.", _obj({"flight": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"}, "from": _str(), "to": _str(), "seats": _int(minimum=1, maximum=500)})),
]
# fmt: on
HOW = {
    "greedy": {"temperature": 0},
    "sampled t0.8": {"temperature": 0.8, "seed": 1},
    "sampled t1.0": {"temperature": 1.0, "seed": 7},
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    rows = []
    with LLM(max_num_seqs=64, max_model_len=1024) as llm:
        for label, how in HOW.items():
            asked, params, refused = [], [], []
            for question, schema in CASES:
                try:
                    spec = StructuredOutputsParams(json=schema)
                except ConfigError as error:
                    refused.append({"question": question, "error": str(error)})
                    continue
                asked.append((question, schema))
                params.append(SamplingParams(max_tokens=args.max_tokens,
                                             structured_outputs=spec, **how))  # fmt: skip
            messages = [[{"role": "user", "content": q}] for q, _ in asked]
            began = time.perf_counter()
            outputs = llm.chat(messages, params, use_tqdm=False)
            wall = time.perf_counter() - began
            failures, tokens = [], []
            for (question, schema), output in zip(asked, outputs, strict=True):
                answer = output.outputs[0]
                tokens.append(len(answer.token_ids))
                checker = jsonschema.Draft202012Validator(
                    schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
                )
                try:
                    checker.validate(json.loads(answer.text))
                    ok = answer.finish_reason == "stop"
                except (ValueError, jsonschema.ValidationError):
                    ok = False
                if not ok:
                    failures.append({"question": question, "finish": answer.finish_reason,
                                     "tokens": len(answer.token_ids),
                                     "start": answer.text[:120]})  # fmt: skip
            row = {"how": label, "valid": len(asked) - len(failures), "answered": len(asked),
                   "refused": refused, "failures": failures, "wall_s": wall,
                   "failed_by_length": sum(f["finish"] == "length" for f in failures),
                   "tokens_max": max(tokens), "tokens_median": sorted(tokens)[len(tokens) // 2]}  # fmt: skip
            rows.append(row)
            print(f"{label}: {row['valid']}/{len(asked)} valid ({len(refused)} refused), "
                  f"{row['failed_by_length']} of the failures at max_tokens, {wall:.1f} s",
                  flush=True)  # fmt: skip
            for failure in failures:
                print(f"  {failure['question']!r} {failure['finish']} {failure['start']!r}")
    path = save("structured-schemas", torch.device("cpu"),
                {"max_tokens": args.max_tokens, "schemas": len(CASES), "runs": rows})  # fmt: skip
    print(f"saved {path}")


if __name__ == "__main__":
    main()
