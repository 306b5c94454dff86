"""An sglang generation backend: the GenerationBackend contract over sglang's engine or HTTP server.

sglang is an optional extra (`pip install -c constraints-sglang.txt -e '.[sglang]'`, sglang 0.5.21) and
needs CUDA; nothing here imports it until `SglangEngine.launch` runs. Written against sglang 0.5.21's own
sources and NOT yet run against a real sglang (no GPU so far); the request and response handling is
tested against tests/sglang_standin.py, a local server that keeps the real one's rules:

- `POST /generate` with `input_ids` (one list per row), per-row `sampling_params` (`temperature`,
  `max_new_tokens`, `stop_token_ids`, and `sampling_seed` only where the server runs with
  `--enable-deterministic-inference`: elsewhere sglang ignores it without a word) and `return_logprob`;
  each answer's `meta_info.output_token_logprobs` is `[[logprob, token_id, text], ...]`, log-probs of
  the temperature-scaled distribution (as the CPU backend reports them; before any top_p/top_k, which
  is why this backend refuses those: TRUNCATION_REFUSED), and
  `meta_info.finish_reason.type` is "stop" or "length" ("abort" is an error here).
- A weight update is a session: `POST /begin_weight_update`, `/update_weights_from_tensor`, then
  `/end_weight_update`; sglang 0.5.21 refuses an update outside one. `serialized_named_tensors` holds one
  entry per tensor-parallel rank (`tp_size` of `GET /server_info`), each the whole (name, tensor) list as
  sglang's MultiprocessingSerializer writes it: base64 of a multiprocessing pickle, CUDA tensors as IPC
  handles, so the server must share the GPUs' host (`serialize_tensors`).
- `GET /server_info` gives the server's arguments: its `dtype` must be the model's `generation.dtype`
  (`--dtype auto` serves a float32 checkpoint, as warm starts are saved, in float16).
- `POST /release_memory_occupation` and `/resume_memory_occupation` (effective with
  `--enable-memory-saver`); both need an idle engine, which a generator between units is.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
import urllib.error
import urllib.request
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch
import torch.multiprocessing

from policies.backend import BackendReleased, Sample, request_rows

NamedTensors = list[tuple[str, torch.Tensor]]
SGLANG_VERSION = "0.5.21"  # the extra's pin (constraints-sglang.txt): the one release on torch 2.13 with update sessions


# sglang draws from the top-k/top-p renormalised distribution but returns each token's log-prob under the whole
# (temperature-scaled) one: its Sampler (srt/layers/sampler.py, as read in recent sources, not run here) returns
# the log of the tempered softmax and truncates a copy. Those are not the behaviour log-probs the learner's
# importance weights need, and a sampled log-prob cannot be renormalised without the kept tokens' total mass
# (top_logprobs_num could give it for top_k, never for a nucleus of unknown size): refused, not approximated.
TRUNCATION_REFUSED = ("sglang reports log-probs of the untruncated distribution, not of the top_p/top_k one it "
                      "samples from; sample with top_p = 1.0 and top_k = 0, or with the hf backends")


class SglangError(RuntimeError):
    """sglang refused a request, answered something this backend cannot read, or is unreachable."""


class Transport(Protocol):
    """How requests reach sglang: an in-process Engine or an HTTP server."""

    info: dict  # the server's arguments (dtype, tp_size, enable_deterministic_inference, ...)

    def generate(self, payload: dict) -> list[dict]: ...
    def update_weights(self, named: NamedTensors, version: int) -> None: ...
    def release(self) -> None: ...
    def resume(self) -> None: ...
    def close(self) -> None: ...


@contextlib.contextmanager
def _shared_by_file():
    """CPU tensors pickled as shared-memory files: a file descriptor (torch's default) only reaches our own
    children, and a server is not one. CUDA tensors go as IPC handles either way."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def serialize_tensors(named: NamedTensors) -> str:
    """``named`` as sglang's MultiprocessingSerializer writes it (base64 of a multiprocessing pickle).

    The tensors must stay alive until the server has taken them (the call that sends them returns)."""
    named = [(n, t.detach().clone() if t.device.type == "cpu" else t.detach()) for n, t in named]  # not the module's
    buffer = io.BytesIO()                                                  # storages: pickling moves them to shm
    with _shared_by_file():
        ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


def server_problem(info: dict, dtype: str) -> str | None:
    """Why a server whose arguments are ``info`` cannot sample a model that trains for ``dtype``, or None."""
    served = info.get("dtype", "auto")
    if served != dtype:
        auto = " (auto serves a float32 checkpoint, as warm starts are saved, in float16)" if served == "auto" else ""
        return f"the sglang server runs --dtype {served}{auto}; start it with --dtype {dtype} (generation.dtype)"
    return None


class SglangHTTP:
    """A running sglang server, addressed by its base URL (`http://host:port`)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.info = self.request("/server_info")

    def request(self, path: str, body: dict | None = None) -> Any:
        """GET ``path`` (no body) or POST ``body`` as JSON; the answer's JSON, None for an empty one."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, headers={"Content-Type": "application/json"},
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise SglangError(f"sglang {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise SglangError(f"sglang {path}: cannot reach {self.base_url}: {exc}") from None
        return json.loads(text) if text else None

    def generate(self, payload: dict) -> list[dict]:
        answer = self.request("/generate", payload)
        return answer if isinstance(answer, list) else [answer]

    def update_weights(self, named: NamedTensors, version: int) -> None:
        payload = serialize_tensors(named)  # one per tensor-parallel rank: each reads its own entry
        body = {"serialized_named_tensors": [payload] * int(self.info.get("tp_size", 1)), "load_format": None,
                "flush_cache": True, "weight_version": str(version)}
        _check_success("/begin_weight_update", self.request("/begin_weight_update", {}))
        try:
            _check_success("/update_weights_from_tensor", self.request("/update_weights_from_tensor", body))
        finally:
            _check_success("/end_weight_update", self.request("/end_weight_update", {}))

    def release(self) -> None:
        self.request("/release_memory_occupation", {})

    def resume(self) -> None:
        self.request("/resume_memory_occupation", {})

    def close(self) -> None:
        pass  # the server is not ours to stop


class SglangEngine:
    """sglang's in-process `Engine` (the colocated path: tensors are handed over without copies)."""

    def __init__(self, engine: Any, info: dict) -> None:
        self.engine, self.info = engine, info

    @classmethod
    def launch(cls, model_path: str, **engine_args: Any) -> SglangEngine:
        import sglang  # optional extra: imported only when an engine is asked for

        return cls(sglang.Engine(model_path=model_path, skip_tokenizer_init=True, **engine_args), engine_args)

    def generate(self, payload: dict) -> list[dict]:
        answer = self.engine.generate(input_ids=payload["input_ids"], sampling_params=payload["sampling_params"],
                                      return_logprob=True)
        return answer if isinstance(answer, list) else [answer]

    def update_weights(self, named: NamedTensors, version: int) -> None:
        _check_success("begin_weight_update", self.engine.begin_weight_update())
        try:
            _check_success("update_weights_from_tensor",
                           self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=True))
        finally:
            _check_success("end_weight_update", self.engine.end_weight_update())

    def release(self) -> None:
        self.engine.release_memory_occupation()

    def resume(self) -> None:
        self.engine.resume_memory_occupation()

    def close(self) -> None:
        self.engine.shutdown()  # its scheduler processes and their GPU memory


def _check_success(what: str, answer: Any) -> None:
    """An answer of sglang's update calls: {"success", "message"} over HTTP, (success, message) from the Engine."""
    if isinstance(answer, tuple):
        answer = {"success": answer[0], "message": answer[1] if len(answer) > 1 else ""}
    if not isinstance(answer, dict) or answer.get("success") is not True:
        message = answer.get("message") if isinstance(answer, dict) else answer
        raise SglangError(f"sglang {what} failed: {message}")


class SglangBackend:
    """GenerationBackend over a Transport: one request per generate call, one row per sample.

    ``seeded``: whether the server honours ``sampling_seed`` (it runs with deterministic inference); where it
    does not, no seed is sent and a given seed does not reproduce a sample."""

    def __init__(self, transport: Transport, eos_token_id: int, stop_ids: tuple[int, ...] = ()) -> None:
        self.transport = transport
        self.eos_token_id = eos_token_id
        self.end_ids = sorted({eos_token_id, *stop_ids})  # a base model's line breaks end a row too
        self.seeded = bool(transport.info.get("enable_deterministic_inference"))
        self.version = 0
        self.released = False

    def generate(self, prompts: list[list[int]], num_samples: int, max_new_tokens: int, temperature: float,
                 seed: int | None = None, top_p: float = 1.0, top_k: int = 0) -> list[list[Sample]]:
        self._check_held("generate")
        rows = request_rows(prompts, num_samples, temperature, top_p, top_k)
        if (top_p, top_k) != (1.0, 0) and temperature > 0:
            raise ValueError(TRUNCATION_REFUSED)
        base = seed if seed is not None else random.SystemRandom().getrandbits(31)
        payload = {"input_ids": rows, "return_logprob": True,
                   "sampling_params": [self._params(max_new_tokens, temperature, base, i) for i in range(len(rows))]}
        answers = self.transport.generate(payload)
        if len(answers) != len(rows):
            raise SglangError(f"sglang /generate answered {len(answers)} outputs for {len(rows)} rows")
        samples = [sample_from_output(a, self.end_ids) for a in answers]
        return [samples[i * num_samples: (i + 1) * num_samples] for i in range(len(prompts))]

    def _params(self, max_new_tokens: int, temperature: float, base: int, row: int) -> dict:
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens,
                  "stop_token_ids": list(self.end_ids), "skip_special_tokens": False}
        if self.seeded:  # each row its own seed: one seed for all would give every sample of a prompt the same tokens
            params["sampling_seed"] = (base * 1_000_003 + row) % 2**31
        return params

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


def engine_args(dtype: str, seed: int, gpu: int, memory_fraction: float, deterministic: bool,
                extra: dict | None = None) -> dict:
    """sglang.Engine's arguments for a generator: the model's dtype (never "auto"), its share of the GPU
    (``mem_fraction_static``: weights + KV cache, a fraction of the memory free when it starts), and
    ``extra`` (``generation.sglang_args``) over them. No memory saver: a role switch shuts the engine down."""
    return {"dtype": dtype, "random_seed": seed, "base_gpu_id": gpu, "mem_fraction_static": memory_fraction,
            "enable_deterministic_inference": deterministic, **(extra or {})}


def sglang_backend(eos_token_id: int, dtype: str, url: str = "", model_path: str = "",
                   args: dict | None = None, stop_ids: tuple[int, ...] = ()) -> SglangBackend:
    """A generator's backend: over the server at ``url`` (whose dtype must be ``dtype``), else over an Engine of
    ``model_path`` started with ``args`` (``engine_args``).

    It starts holding no weights of the run (version -1), so the first load pushes the current ones."""
    if url:
        transport: Transport = SglangHTTP(url)
        if problem := server_problem(transport.info, dtype):
            raise SglangError(problem)
    else:
        transport = SglangEngine.launch(model_path, **(args or {}))
    backend = SglangBackend(transport, eos_token_id, stop_ids)
    backend.version = -1
    return backend


def sample_from_output(output: dict, end_ids: int | list[int]) -> Sample:
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
    ends = [end_ids] if isinstance(end_ids, int) else end_ids
    if reason == "stop" and (not ids or ids[-1] not in ends):
        raise SglangError(f"sglang stopped a row on {meta['finish_reason']!r}, not on an end token {ends}")
    return Sample(completion_ids=ids, logprobs=logprobs, finish_reason=reason)
