"""A local stand-in for an sglang 0.5.21 server: its JSON and its rules, answered by a real tiny model.

It serves /generate, /begin_weight_update, /update_weights_from_tensor, /end_weight_update,
/release_memory_occupation, /resume_memory_occupation, GET /server_info and /health on 127.0.0.1
with a real HFBackend behind them, so the sglang backend's requests meet real sampling, EOS,
log-probs and weights. It keeps what sglang 0.5.21 requires and refuses what it refuses (400 and
{"success": false, "message"} where sglang answers so): an update outside a begin/end session,
fewer payloads than tensor-parallel ranks, a payload that is not a multiprocessing pickle of
(name, tensor) pairs (safetensors bytes, say), sampling params that are not one dict per row. Like
sglang it ignores `sampling_seed` unless started deterministic, and reports the dtype it was given.
"""

from __future__ import annotations

import base64
import json
import pickle
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from engine.train.group import params_digest
from policies.backend import HFBackend


class StandIn:
    """`with StandIn(backend) as url:` runs the server on a free port for the block."""

    def __init__(self, backend: HFBackend, dtype: str = "float32", tp_size: int = 1, deterministic: bool = True) -> None:
        self.backend = backend
        self.info = {"version": "0.5.21", "dtype": dtype, "tp_size": tp_size,
                     "enable_deterministic_inference": deterministic}  # what GET /server_info reports
        self.requests: list[tuple[str, dict]] = []  # every request, in order, for the tests to read
        self.released = False
        self.updating = False  # between /begin_weight_update and /end_weight_update
        self.digests: dict[int, str] = {}  # weight version -> params_digest of the weights it was sent
        self.lock = threading.Lock()  # one request at a time: sglang's scheduler serialises them too
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, body: dict) -> tuple[int, object]:
        with self.lock:
            self.requests.append((path, body))
            route = {"/generate": self._generate, "/update_weights_from_tensor": self._update,
                     "/begin_weight_update": self._begin, "/end_weight_update": self._end,
                     "/release_memory_occupation": self._release, "/resume_memory_occupation": self._resume}
            if path not in route:
                return 404, {"error": f"no route {path}"}
            return route[path](body)

    def _generate(self, body: dict) -> tuple[int, object]:
        if self.released:
            return 400, {"error": "memory released: resume_memory_occupation first"}
        rows, params = body["input_ids"], body["sampling_params"]
        if not isinstance(params, list) or len(params) != len(rows):
            return 400, {"error": "sampling_params must be one dict per input_ids row"}
        return 200, [self._one(row, p, bool(body.get("return_logprob"))) for row, p in zip(rows, params)]

    def _one(self, row: list[int], p: dict, with_logprobs: bool) -> dict:
        stops = p.get("stop_token_ids") or []
        if stops != [self.backend.eos_token_id]:
            raise ValueError(f"the stand-in stops on EOS {self.backend.eos_token_id} only, asked {stops}")
        seed = p.get("sampling_seed") if self.info["enable_deterministic_inference"] else None  # else ignored
        seed = random.getrandbits(31) if seed is None else seed
        ((s,),) = self.backend.generate([row], 1, p["max_new_tokens"], p["temperature"], seed=seed)
        meta = {"id": str(len(self.requests)), "prompt_tokens": len(row), "completion_tokens": len(s.completion_ids),
                "finish_reason": ({"type": "stop", "matched": s.completion_ids[-1]} if s.finish_reason == "stop"
                                  else {"type": "length", "length": len(s.completion_ids)})}
        if with_logprobs:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(s.logprobs, s.completion_ids)]
        return {"text": "", "output_ids": s.completion_ids, "meta_info": meta}

    def _begin(self, body: dict) -> tuple[int, object]:
        if self.updating:
            return 400, {"success": False, "message": "a weight update session is already open"}
        self.updating = True
        return 200, {"success": True, "message": ""}

    def _end(self, body: dict) -> tuple[int, object]:
        if not self.updating:
            return 400, {"success": False, "message": "no weight update session is open"}
        self.updating = False
        return 200, {"success": True, "message": ""}

    def _update(self, body: dict) -> tuple[int, object]:
        if not self.updating:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                      "begin_weight_update() and end_weight_update()"}
        if self.released:
            return 400, {"success": False, "message": "weights are released"}
        payloads = body["serialized_named_tensors"]
        if len(payloads) < self.info["tp_size"]:  # rank r reads entry r
            return 400, {"success": False, "message": f"list index out of range (tp rank {len(payloads)})"}
        try:  # as sglang's MultiprocessingSerializer reads it: base64, then a multiprocessing pickle
            named = pickle.loads(base64.b64decode(payloads[0]))
            tensors = dict(named)
            if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise TypeError("not (name, tensor) pairs")
            with torch.no_grad():  # by name, as sglang updates: the tensors sent, each one known
                unknown = self.backend.model.load_state_dict(tensors, strict=False).unexpected_keys
            if unknown:
                raise RuntimeError(f"no such weights: {unknown[:3]}")
        except Exception as exc:  # noqa: BLE001  sglang answers any failure to load as this one message
            return 400, {"success": False, "message": f"Failed to update weights: {exc}"[:200]}
        self.backend.version = int(body["weight_version"])
        self.digests[self.backend.version] = params_digest(self.backend.model)
        return 200, {"success": True, "message": f"Success. Weight version updated to {self.backend.version}."}

    def _release(self, body: dict) -> tuple[int, object]:
        self.released = True
        return 200, None

    def _resume(self, body: dict) -> tuple[int, object]:
        self.released = False
        return 200, None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                try:
                    code, answer = standin.answer(self.path, body)
                except (KeyError, ValueError, TypeError) as exc:
                    code, answer = 400, {"error": repr(exc)}
                data = b"" if answer is None else json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802  sglang's GET /health (empty when serving) and /server_info
                data = json.dumps(standin.info).encode() if self.path == "/server_info" else b""
                self.send_response(200 if self.path in ("/health", "/server_info") else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # keep pytest's output clean
                pass

        return Handler
