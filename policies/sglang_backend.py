"""An sglang generation backend: the GenerationBackend contract over sglang's engine or HTTP server.

sglang is an optional extra (`pip install .[sglang]`) and needs CUDA; nothing here imports it
until `SglangEngine.launch` or the default tensor serializer runs. Written against sglang's
documented native API and NOT yet run against a real sglang (no GPU so far); the request and
response handling is tested against tests/sglang_standin.py, a local server answering with the
documented JSON:

- `POST /generate` with `input_ids` (one list per row), per-row `sampling_params`
  (`temperature`, `max_new_tokens`, `stop_token_ids`, `sampling_seed`) and `return_logprob`;
  each answer's `meta_info.output_token_logprobs` is `[[logprob, token_id, text], ...]` and
  `meta_info.finish_reason.type` is "stop" or "length" ("abort" is an error here).
- `POST /update_weights_from_tensor` with `serialized_named_tensors` (sglang's
  MultiprocessingSerializer: same host, colocated), `flush_cache`, `weight_version`.
- `POST /release_memory_occupation` and `/resume_memory_occupation` (server started with
  `--enable-memory-saver`); both need an idle engine, which a generator between units is.

Log-probs must be those of the distribution sampled from (temperature applied), as the CPU
backend reports them; which one sglang returns depends on its version and flags: check on a GPU.
"""

from __future__ import annotations

import base64
import json
import random
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol

import torch

from policies.backend import BackendReleased, Sample, request_rows

NamedTensors = list[tuple[str, torch.Tensor]]


class SglangError(RuntimeError):
    """sglang refused a request, answered something this backend cannot read, or is unreachable."""


class Transport(Protocol):
    """How requests reach sglang: an in-process Engine or an HTTP server."""

    def generate(self, payload: dict) -> list[dict]: ...
    def update_weights(self, named: NamedTensors, version: int) -> None: ...
    def release(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...


def sglang_serializer(named: NamedTensors) -> str:
    """sglang's own serialization of colocated tensors (CUDA IPC handles, not bytes)."""
    from sglang.srt.utils import MultiprocessingSerializer  # optional extra: imported only when used

    return MultiprocessingSerializer.serialize(named, output_str=True)


class SglangHTTP:
    """A running sglang server, addressed by its base URL (`http://host:port`)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0,
                 serialize: Callable[[NamedTensors], str] = sglang_serializer) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.serialize = serialize

    def post(self, path: str, body: dict) -> Any:
        request = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise SglangError(f"sglang {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise SglangError(f"sglang {path}: cannot reach {self.base_url}: {exc}") from None
        return json.loads(text) if text else None

    def generate(self, payload: dict) -> list[dict]:
        answer = self.post("/generate", payload)
        return answer if isinstance(answer, list) else [answer]

    def update_weights(self, named: NamedTensors, version: int) -> None:
        body = {"serialized_named_tensors": [self.serialize(named)], "load_format": None,
                "flush_cache": True, "weight_version": str(version)}
        _check_success("/update_weights_from_tensor", self.post("/update_weights_from_tensor", body))

    def release(self) -> None:
        self.post("/release_memory_occupation", {})

    def resume(self) -> None:
        self.post("/resume_memory_occupation", {})

    def close(self) -> None:
        pass  # the server is not ours to stop


class SglangEngine:
    """sglang's in-process `Engine` (the colocated path: tensors are handed over without copies)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @classmethod
    def launch(cls, model_path: str, seed: int = 0, **engine_args: Any) -> SglangEngine:
        import sglang  # optional extra: imported only when an engine is asked for

        return cls(sglang.Engine(model_path=model_path, random_seed=seed, skip_tokenizer_init=True,
                                 enable_memory_saver=True, **engine_args))

    def generate(self, payload: dict) -> list[dict]:
        answer = self.engine.generate(input_ids=payload["input_ids"], sampling_params=payload["sampling_params"],
                                      return_logprob=True)
        return answer if isinstance(answer, list) else [answer]

    def update_weights(self, named: NamedTensors, version: int) -> None:
        answer = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        if isinstance(answer, tuple):  # (success, message) in the engine API
            answer = {"success": answer[0], "message": answer[1] if len(answer) > 1 else ""}
        _check_success("update_weights_from_tensor", answer)

    def release(self) -> None:
        self.engine.release_memory_occupation()

    def resume(self) -> None:
        self.engine.resume_memory_occupation()

    def close(self) -> None:
        self.engine.shutdown()  # its scheduler processes and their GPU memory


def _check_success(what: str, answer: Any) -> None:
    if not isinstance(answer, dict) or answer.get("success") is not True:
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise SglangError(f"sglang {what} failed: {message}")


class SglangBackend:
    """GenerationBackend over a Transport: one request per generate call, one row per sample."""

    def __init__(self, transport: Transport, eos_token_id: int) -> None:
        self.transport = transport
        self.eos_token_id = eos_token_id
        self.version = 0
        self.released = False

    def generate(self, prompts: list[list[int]], num_samples: int, max_new_tokens: int,
                 temperature: float, seed: int | None = None) -> list[list[Sample]]:
        self._check_held("generate")
        rows = request_rows(prompts, num_samples, temperature)
        base = seed if seed is not None else random.SystemRandom().getrandbits(31)
        payload = {"input_ids": rows, "return_logprob": True,
                   "sampling_params": [self._params(max_new_tokens, temperature, base, i) for i in range(len(rows))]}
        answers = self.transport.generate(payload)
        if len(answers) != len(rows):
            raise SglangError(f"sglang /generate answered {len(answers)} outputs for {len(rows)} rows")
        samples = [sample_from_output(a, self.eos_token_id) for a in answers]
        return [samples[i * num_samples: (i + 1) * num_samples] for i in range(len(prompts))]

    def _params(self, max_new_tokens: int, temperature: float, base: int, row: int) -> dict:
        # Each row its own seed: one seed for all would give every sample of a prompt the same tokens.
        return {"temperature": temperature, "max_new_tokens": max_new_tokens,
                "stop_token_ids": [self.eos_token_id], "skip_special_tokens": False,
                "sampling_seed": (base * 1_000_003 + row) % 2**31}

    def load_state_dict(self, state: dict[str, torch.Tensor], version: int) -> None:
        self._check_held("load_state_dict")
        self.transport.update_weights(list(state.items()), version)
        self.version = version

    def release_memory(self) -> None:
        self.transport.release()
        self.released = True

    def resume_memory(self) -> None:
        self.transport.resume()
        self.released = False

    def close(self) -> None:
        self.transport.close()

    def _check_held(self, what: str) -> None:
        if self.released:
            raise BackendReleased(f"{what}: the backend's memory is released; call resume_memory() first")


def sglang_backend(eos_token_id: int, url: str = "", tensors: str = "ipc", model_path: str = "", gpu: int = 0,
                   seed: int = 0, engine_args: dict | None = None) -> SglangBackend:
    """A generator's backend: over the server at ``url``, else over an Engine of ``model_path`` on GPU ``gpu``.

    It starts holding no weights of the run (version -1), so the first load pushes the current ones."""
    if url:
        serialize = encode_tensors if tensors == "safetensors" else sglang_serializer
        transport: Transport = SglangHTTP(url, serialize=serialize)
    else:
        transport = SglangEngine.launch(model_path, seed=seed, base_gpu_id=gpu, **(engine_args or {}))
    backend = SglangBackend(transport, eos_token_id)
    backend.version = -1
    return backend


def sample_from_output(output: dict, eos_token_id: int) -> Sample:
    """One /generate output as a Sample; anything off the documented shape is one SglangError."""
    try:
        meta = output["meta_info"]
        pairs = meta["output_token_logprobs"]
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        reason = meta["finish_reason"]["type"]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise SglangError(f"sglang output lacks token ids/log-probs/finish reason ({exc!r}); "
                          f"was return_logprob sent?") from None
    if reason not in ("stop", "length"):
        raise SglangError(f"sglang finished a row with {meta['finish_reason']!r}")
    if reason == "stop" and (not ids or ids[-1] != eos_token_id):
        raise SglangError(f"sglang stopped a row on {meta['finish_reason']!r}, not on EOS {eos_token_id}")
    return Sample(completion_ids=ids, logprobs=logprobs, finish_reason=reason)


def encode_tensors(named: NamedTensors) -> str:
    """Plain bytes of the tensors (safetensors, base64) for a transport that crosses hosts or tests."""
    from safetensors.torch import save

    return base64.b64encode(save({k: v.contiguous() for k, v in named})).decode()
