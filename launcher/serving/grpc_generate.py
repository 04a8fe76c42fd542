"""gRPC front end: `GenerateService` of proto/speedpipe.proto, served by the coordinator's process.

`Generate` streams one `GenerateResponse` per commit; the last has finish_reason, usage and timing.
`GetModelInfo` describes the model, the pipeline and the request limits (`model_info`).
Status codes: INVALID_ARGUMENT for bad input (the message names the field) and for a request that
does not parse as its RPC's type (workers/rpc/request_parse.py; grpcio's own answer is INTERNAL),
RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when the pipeline failed or the server is
fenced or draining (also mid-stream); these carry google.rpc details (workers/rpc/status_details.py):

| code | when | details |
| --- | --- | --- |
| INVALID_ARGUMENT | a request field is invalid | BadRequest (the field, the message); ErrorInfo INVALID_FIELD |
| INVALID_ARGUMENT | its masks left no token mid-way (also mid-stream) | BadRequest (the first field); ErrorInfo INVALID_FIELD |
| INVALID_ARGUMENT | the request does not parse | BadRequest (the fields, or "": all); ErrorInfo UNPARSABLE_REQUEST |
| RESOURCE_EXHAUSTED | the queue is full | ErrorInfo QUEUE_FULL (both limits); RetryInfo `QUEUE_FULL_RETRY_S` |
| UNAVAILABLE | draining for shutdown | ErrorInfo DRAINING; RetryInfo `DRAINING_RETRY_S` |
| UNAVAILABLE | a stage without fail-over is silent | ErrorInfo STAGE_SILENT (no RetryInfo: the heartbeat decides) |
| UNAVAILABLE | fenced after a failure, or the pipeline failed | ErrorInfo PIPELINE_FAILED (no RetryInfo) |
| INTERNAL | this request alone failed (non-finite logits, a grammar matcher's error); the server stays up | ErrorInfo REQUEST_FAILED |
| UNAUTHENTICATED | no or a wrong `authorization: Bearer KEY` with --api-key | ErrorInfo CREDENTIALS_MISSING / CREDENTIALS_INVALID (metadataKey) |

A RetryInfo comes with the `grpc-retry-pushback-ms` trailer of the same delay, which gRPC's client-side
retry policy reads (gRFC A6).

UNAUTHENTICATED for Generate and GetModelInfo without the right
`authorization: Bearer KEY` metadata when the server has --api-key (workers/rpc/control_auth.py; Health
stays open, as HTTP /health). A cancelled RPC (client gone, deadline passed) aborts the request, freeing its KV slot on
every stage. `Health` is SERVING only while the coordinator and every stage are, NOT_SERVING while
draining or restarting a stage, and UNHEALTHY after a failure for good; grpc.health.v1 and
reflection: launcher/serving/grpc_health.py.
Must not: hold generation logic (launcher/serving/serving_engine.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import re
import uuid
from typing import NoReturn

import grpc

from launcher.backends.ports import format_address, listen_socket
from launcher.coordinator.coordinator import PipelineError
from launcher.coordinator.request_handle import NoTokenLeftError, RequestError, TextOptions
from launcher.serving.formats.response_format import grammar_from_proto
from launcher.serving.formats.vllm_fields import encode_truncated, truncated, truncation_limit
from launcher.serving.grpc_health import MAX_WATCHES, OPEN_METHODS, enable_standard_services
from launcher.serving.openai_protocol import API_SEED_LIMIT, MAX_STOP_STRINGS
from launcher.serving.serving_engine import (
    MAX_TEMPERATURE,
    InvalidRequestError,
    QueueFullError,
    ServingEngine,
    UnavailableError,
    shown,
)
from pipeline.speculation.grammar import MAX_GRAMMAR_CHARS
from pipeline.speculation.logprobs import TokenLogprob
from pipeline.speculation.masks.token_masks import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_TOKEN_IDS,
)
from pipeline.speculation.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_LOGPROBS,
    SamplingParamError,
    SamplingParams,
)
from proto import speedpipe_pb2 as pb
from proto import speedpipe_pb2_grpc as pb_grpc
from workers.rpc.control_auth import API_KEY_METADATA_KEY, SecretCheckInterceptor
from workers.rpc.request_parse import RequestParseInterceptor
from workers.rpc.status_details import abort_with_details

log = logging.getLogger("speedpipe.serve")
MAX_REQUEST_ID_CHARS = 256  # it is logged and echoed in every response
_FLOAT32 = re.compile(r"-?\d+\.\d{9,}(?:e-?\d+)?")  # a float32 field printed as a double
HEALTH = {"serving": pb.HealthResponse.SERVING, "not_serving": pb.HealthResponse.NOT_SERVING,
          "unhealthy": pb.HealthResponse.UNHEALTHY}
FINISH = {"length": pb.GenerateResponse.LENGTH, "stop": pb.GenerateResponse.STOP, "eos": pb.GenerateResponse.EOS,
          "aborted": pb.GenerateResponse.ABORTED}

MASK_LIMITS = {"max_stop_token_ids": MAX_STOP_TOKEN_IDS, "max_allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
               "max_bad_words": MAX_BAD_WORDS, "max_bad_word_chars": MAX_BAD_WORD_CHARS}  # RequestLimits fields
# A slot frees whenever any outstanding request finishes: a first back-off; clients should back off more
# on a repeat (exponentially, as gRPC's retry policy does).
QUEUE_FULL_RETRY_S = 1.0
# The draining server leaves its Service at its next failed readiness probe (deploy/statefulset.yaml);
# a client should reconnect (a new channel reaches another replica) rather than retry on this one.
DRAINING_RETRY_S = 1.0


def abort_invalid(context: grpc.ServicerContext, message: str, field: str) -> NoReturn:
    """End the RPC with INVALID_ARGUMENT `message`, a BadRequest naming `field` (the request's field
    path, e.g. "temperature") with `message` as its description, and ErrorInfo INVALID_FIELD."""
    abort_with_details(context, grpc.StatusCode.INVALID_ARGUMENT, message, violations=[(field, message)],
                       reason="INVALID_FIELD", metadata={"field": field})


def abort_refused(context: grpc.ServicerContext, exc: QueueFullError | UnavailableError | PipelineError,
                  engine: ServingEngine) -> NoReturn:
    """End the RPC for a request the server does not run now: RESOURCE_EXHAUSTED for a full queue,
    UNAVAILABLE while draining, for a silent stage, or after a failure; the details as in the table
    in the module docstring. The message is the one the front end always gave."""
    if isinstance(exc, QueueFullError):
        abort_with_details(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), reason="QUEUE_FULL",
                           metadata={"maxNumSeqs": str(engine.max_num_seqs), "maxQueue": str(engine.max_queue)},
                           retry_delay_s=QUEUE_FULL_RETRY_S)
    if isinstance(exc, PipelineError):
        abort_with_details(context, grpc.StatusCode.UNAVAILABLE, f"pipeline failed: {exc}", reason="PIPELINE_FAILED")
    if engine.fenced is None:  # refused without a fence: a silent stage (ServingEngine.start)
        abort_with_details(context, grpc.StatusCode.UNAVAILABLE, str(exc), reason="STAGE_SILENT")
    if engine.health_status()[0] == "not_serving":  # a fence that is not a failure's: a drain
        abort_with_details(context, grpc.StatusCode.UNAVAILABLE, str(exc), reason="DRAINING",
                           retry_delay_s=DRAINING_RETRY_S)
    abort_with_details(context, grpc.StatusCode.UNAVAILABLE, str(exc), reason="PIPELINE_FAILED")


def request_params(req: pb.GenerateRequest, engine: ServingEngine) -> tuple[list[int], SamplingParams]:
    """Prompt ids and sampling parameters of a GenerateRequest. Raises InvalidRequestError naming the field."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"'request_id' has {len(req.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}",
                                  "request_id")
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequestError("exactly one of 'prompt' or 'prompt_token_ids' must be set", "prompt")
    keep = truncation_limit(req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None,
                            engine.max_model_len, max_tokens=req.max_new_tokens, error=InvalidRequestError)
    if which == "prompt":
        if not req.prompt:
            raise InvalidRequestError("'prompt' is empty", "prompt")
        try:
            engine.tokenizer.check_fits(req.prompt, engine.max_model_len if keep is None else 2**31, what="'prompt'")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "prompt") from None
        ids = encode_truncated(engine.tokenizer, req.prompt, keep, True)
    else:
        ids = truncated(req.prompt_token_ids.ids, keep)
    if req.max_new_tokens < 1:  # proto3 sends no 0: unset and 0 look the same
        raise InvalidRequestError("'max_new_tokens' is unset or 0; it is required, at least 1 (no default, unlike "
                                  "HTTP's max_tokens)", "max_new_tokens")
    engine.check_prompt(ids, req.max_new_tokens, prompt_field=which, budget_field="max_new_tokens")
    if len(req.stop) > MAX_STOP_STRINGS:  # HTTP's rules (OpenAI: up to 4, none empty)
        raise InvalidRequestError(f"'stop' has {len(req.stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if not all(req.stop):
        raise InvalidRequestError("'stop' strings must not be empty", "stop")
    if req.HasField("seed") and req.seed >= API_SEED_LIMIT:  # HTTP's range (vLLM's: a signed 64-bit seed)
        raise InvalidRequestError(f"'seed' must be in [0, 2**63), got {shown(req.seed)}", "seed")
    if not 0.0 <= req.temperature <= MAX_TEMPERATURE:  # also NaN; HTTP's range
        raise InvalidRequestError(f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {req.temperature:.7g}",
                                  "temperature")
    for name in ("logprobs", "prompt_logprobs"):  # SamplingParams says "None or ..."
        if req.HasField(name) and not 0 <= getattr(req, name) <= MAX_LOGPROBS:
            raise InvalidRequestError(f"'{name}' must be in [0, {MAX_LOGPROBS}] when set, got {shown(getattr(req, name))}",
                                      name)
    try:
        params = SamplingParams(max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                                top_p=req.top_p if req.HasField("top_p") else 1.0,
                                seed=req.seed if req.HasField("seed") else None,
                                stop=tuple(req.stop), ignore_eos=req.ignore_eos,
                                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
                                logprobs=req.logprobs if req.HasField("logprobs") else None,
                                prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
                                top_k=req.top_k, min_p=req.min_p, logit_bias=dict(req.logit_bias),
                                grammar=grammar_from_proto(req, error=InvalidRequestError),
                                min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids),
                                allowed_token_ids=tuple(req.allowed_token_ids) or None, bad_words=tuple(req.bad_words))
        params.check_vocab(engine.tokenizer.vocab_size)
    except SamplingParamError as exc:  # "top_p must be ..." -> "'top_p' must be ..."; the proto's field names
        message = _FLOAT32.sub(lambda m: f"{float(m.group()):.7g}", str(exc))  # -0.10000000149011612 -> -0.1
        field = "structured_output" if exc.param == "response_format" else exc.param
        raise InvalidRequestError.of_setting(exc, field, message) from None
    return ids, params


def text_options(req: pb.GenerateRequest) -> TextOptions:
    """The output-text settings of a GenerateRequest (unset: vLLM's defaults)."""
    return TextOptions(
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(req.spaces_between_special_tokens
                                       if req.HasField("spaces_between_special_tokens") else True),
        include_stop_str_in_output=req.include_stop_str_in_output)


def model_info(engine: ServingEngine) -> pb.ModelInfo:
    """GetModelInfo's answer: what HTTP's /v1/models says (the engine's model name and max_model_len),
    the tokenizer's vocabulary and special tokens, the engine's pipeline description and the limits
    `request_params` and admission enforce."""
    tok = engine.tokenizer
    info = pb.ModelInfo(model_id=engine.model_name, max_model_len=engine.max_model_len, vocab_size=tok.vocab_size,
                        eos_token_ids=tok.eos_token_ids, bos_token_id=tok.bos_token_id,
                        limits=pb.RequestLimits(max_num_seqs=engine.max_num_seqs, max_queue=engine.max_queue,
                                                max_temperature=MAX_TEMPERATURE, max_logprobs=MAX_LOGPROBS,
                                                max_stop_strings=MAX_STOP_STRINGS,
                                                max_request_id_chars=MAX_REQUEST_ID_CHARS, max_seed=API_SEED_LIMIT - 1,
                                                max_logit_bias_entries=MAX_LOGIT_BIAS_ENTRIES,
                                                max_logit_bias=MAX_LOGIT_BIAS, **MASK_LIMITS,
                                                max_structured_output_chars=MAX_GRAMMAR_CHARS))
    if engine.pipeline is not None:
        info.pipeline.CopyFrom(pb.PipelineInfo(**dataclasses.asdict(engine.pipeline)))
    return info


def _token_logprob(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top])


class GenerateServicer(pb_grpc.GenerateServiceServicer):
    """GenerateService over a ServingEngine."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802 - gRPC name
        try:
            ids, params = request_params(request, self.engine)
            rid = request.request_id or f"grpc-{uuid.uuid4().hex[:24]}"
            stream = self.engine.start(ids, params, request_id=rid, text=text_options(request))
        except InvalidRequestError as exc:
            abort_invalid(context, str(exc), exc.param or "")
        except ValueError as exc:  # the coordinator's prompt checks (encode_prompt), past request_params'
            abort_invalid(context, str(exc), request.WhichOneof("input") or "prompt")
        except (QueueFullError, UnavailableError, PipelineError) as exc:
            abort_refused(context, exc, self.engine)
        # Runs when the RPC ends (a no-op unless it was cancelled). grpc refuses it (False) when the RPC
        # ended already (deadline passed or client gone while the request was admitted): cancel now.
        if not context.add_callback(stream.cancel):
            stream.cancel()
            return
        try:
            for chunk in stream:
                msg = pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text,
                                          logprobs=[_token_logprob(e) for e in chunk.logprobs or ()],
                                          prompt_logprobs=[_token_logprob(e) for e in chunk.prompt_logprobs or ()
                                                           if e is not None])  # the first token's is None
                if chunk.finish_reason is not None:
                    msg.finish_reason = FINISH.get(chunk.finish_reason, pb.GenerateResponse.ABORTED)
                    if isinstance(chunk.stop_reason, int):  # a stop token id
                        msg.stop_token_id = chunk.stop_reason
                    else:
                        msg.stop_reason = chunk.stop_reason or ""
                    final = stream.final
                    msg.usage.prompt_tokens, msg.usage.completion_tokens = final.prompt_tokens, final.completion_tokens
                    msg.timing.ttft_s, msg.timing.e2e_s = final.ttft_s, final.e2e_s
                yield msg
        except NoTokenLeftError as exc:  # its own masks left no token: bad input ([Note: no token left])
            abort_invalid(context, str(exc), "structured_output" if exc.param == "response_format" else exc.param)
        except RequestError as exc:  # this request alone failed; the server stays up
            abort_with_details(context, grpc.StatusCode.INTERNAL, str(exc), reason="REQUEST_FAILED")
        except (UnavailableError, PipelineError) as exc:
            abort_refused(context, exc, self.engine)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:  # noqa: N802
        state, why = self.engine.health_status()
        return pb.HealthResponse(status=HEALTH[state], message=why)

    def GetModelInfo(self, request: pb.GetModelInfoRequest,  # noqa: N802 - gRPC name
                     context: grpc.ServicerContext) -> pb.ModelInfo:
        return model_info(self.engine)


class GrpcServer:
    """A gRPC server with GenerateService on host:port (port 0 = any free port; see `.port`);
    Generate needs `authorization: Bearer api_key` metadata when api_key is set."""

    def __init__(self, engine: ServingEngine, *, host: str, port: int, api_key: str | None = None) -> None:
        # one thread per stream, plus refusals and health Watch streams
        workers = engine.max_num_seqs + engine.max_queue + 4 + MAX_WATCHES
        interceptors = [] if api_key is None else [SecretCheckInterceptor(
            key=API_KEY_METADATA_KEY, expected=f"Bearer {api_key}", what="API key (`authorization: Bearer KEY`)",
            exempt=("/speedpipe.v1.GenerateService/Health", *OPEN_METHODS))]
        interceptors.append(RequestParseInterceptor())  # after the key check: no parse error before UNAUTHENTICATED
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                                                        thread_name_prefix="grpc-generate"),
                                  maximum_concurrent_rpcs=workers, interceptors=interceptors,
                                  options=[("grpc.so_reuseport", 0)])  # grpc's default 1 lets 2 servers share a port
        pb_grpc.add_GenerateServiceServicer_to_server(GenerateServicer(engine), self.server)
        enable_standard_services(self.server, engine.health_status)
        try:  # asked first, so a port taken is one line with the reason, not also grpc's own log line
            listen_socket(host, port).close()
            self.port = self.server.add_insecure_port(format_address(host, port))
        except OSError as exc:
            raise RuntimeError(f"cannot listen for gRPC on {format_address(host, port)} ({exc.strerror})") from None
        except RuntimeError:  # newer grpc raises on a failed bind; older returned 0
            self.port = 0
        if self.port == 0:
            raise RuntimeError(f"cannot listen for gRPC on {format_address(host, port)}")

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
