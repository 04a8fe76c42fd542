from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadStageRequest(_message.Message):
    __slots__ = ("model_dir", "stage_index", "num_stages", "layer_start", "layer_stop", "dtype", "device", "max_num_seqs", "max_model_len", "num_threads", "dist_rank", "dist_world_size", "dist_master_addr", "dist_master_port", "stage_timeout_s", "exit_layer", "exit_predictor", "firp_layer", "firp_k", "firp_file", "quantization", "calibrate_max_rows", "tree_scratch", "dense_layout")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DIST_RANK_FIELD_NUMBER: _ClassVar[int]
    DIST_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIST_MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    DIST_MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    STAGE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXIT_PREDICTOR_FIELD_NUMBER: _ClassVar[int]
    FIRP_LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRP_K_FIELD_NUMBER: _ClassVar[int]
    FIRP_FILE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    TREE_SCRATCH_FIELD_NUMBER: _ClassVar[int]
    DENSE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    stage_index: int
    num_stages: int
    layer_start: int
    layer_stop: int
    dtype: str
    device: str
    max_num_seqs: int
    max_model_len: int
    num_threads: int
    dist_rank: int
    dist_world_size: int
    dist_master_addr: str
    dist_master_port: int
    stage_timeout_s: float
    exit_layer: int
    exit_predictor: bytes
    firp_layer: int
    firp_k: int
    firp_file: bytes
    quantization: str
    calibrate_max_rows: int
    tree_scratch: int
    dense_layout: str
    def __init__(self, model_dir: _Optional[str] = ..., stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_threads: _Optional[int] = ..., dist_rank: _Optional[int] = ..., dist_world_size: _Optional[int] = ..., dist_master_addr: _Optional[str] = ..., dist_master_port: _Optional[int] = ..., stage_timeout_s: _Optional[float] = ..., exit_layer: _Optional[int] = ..., exit_predictor: _Optional[bytes] = ..., firp_layer: _Optional[int] = ..., firp_k: _Optional[int] = ..., firp_file: _Optional[bytes] = ..., quantization: _Optional[str] = ..., calibrate_max_rows: _Optional[int] = ..., tree_scratch: _Optional[int] = ..., dense_layout: _Optional[str] = ...) -> None: ...

class LoadStageResponse(_message.Message):
    __slots__ = ("weights_bytes", "num_parameters", "load_s", "tensor_names", "row_costs", "row_cost_mode", "calibrate_s", "exit_head_row_s")
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    ROW_COSTS_FIELD_NUMBER: _ClassVar[int]
    ROW_COST_MODE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_HEAD_ROW_S_FIELD_NUMBER: _ClassVar[int]
    weights_bytes: int
    num_parameters: int
    load_s: float
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    row_costs: _containers.RepeatedCompositeFieldContainer[RowCost]
    row_cost_mode: str
    calibrate_s: float
    exit_head_row_s: float
    def __init__(self, weights_bytes: _Optional[int] = ..., num_parameters: _Optional[int] = ..., load_s: _Optional[float] = ..., tensor_names: _Optional[_Iterable[str]] = ..., row_costs: _Optional[_Iterable[_Union[RowCost, _Mapping]]] = ..., row_cost_mode: _Optional[str] = ..., calibrate_s: _Optional[float] = ..., exit_head_row_s: _Optional[float] = ...) -> None: ...

class RowCost(_message.Message):
    __slots__ = ("num_rows", "pass_s")
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    PASS_S_FIELD_NUMBER: _ClassVar[int]
    num_rows: int
    pass_s: float
    def __init__(self, num_rows: _Optional[int] = ..., pass_s: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "message")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[HealthResponse.Status]
        SERVING: _ClassVar[HealthResponse.Status]
        NOT_LOADED: _ClassVar[HealthResponse.Status]
        UNHEALTHY: _ClassVar[HealthResponse.Status]
        NOT_SERVING: _ClassVar[HealthResponse.Status]
    STATUS_UNSPECIFIED: HealthResponse.Status
    SERVING: HealthResponse.Status
    NOT_LOADED: HealthResponse.Status
    UNHEALTHY: HealthResponse.Status
    NOT_SERVING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    message: str
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., message: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageStats(_message.Message):
    __slots__ = ("wall_ns", "busy_ns", "items_processed", "tokens_processed", "messages_received", "rss_bytes", "weights_bytes", "kv_cache_bytes", "kv_slots_in_use")
    WALL_NS_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    ITEMS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    wall_ns: int
    busy_ns: int
    items_processed: int
    tokens_processed: int
    messages_received: int
    rss_bytes: int
    weights_bytes: int
    kv_cache_bytes: int
    kv_slots_in_use: int
    def __init__(self, wall_ns: _Optional[int] = ..., busy_ns: _Optional[int] = ..., items_processed: _Optional[int] = ..., tokens_processed: _Optional[int] = ..., messages_received: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., weights_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_slots_in_use: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("reset_stats", "clear_kv_cache")
    RESET_STATS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    reset_stats: bool
    clear_kv_cache: bool
    def __init__(self, reset_stats: _Optional[bool] = ..., clear_kv_cache: _Optional[bool] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RejoinRequest(_message.Message):
    __slots__ = ("dist_master_port", "join_timeout_s", "attempt")
    DIST_MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    dist_master_port: int
    join_timeout_s: float
    attempt: int
    def __init__(self, dist_master_port: _Optional[int] = ..., join_timeout_s: _Optional[float] = ..., attempt: _Optional[int] = ...) -> None: ...

class RejoinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "max_new_tokens", "temperature", "top_p", "seed", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_k", "min_p", "logit_bias", "structured_output", "min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: TokenIds
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    top_k: int
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    structured_output: StructuredOutput
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    truncate_prompt_tokens: int
    prompt_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[str]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_object: bool
    json_schema: str
    regex: str
    choice: Choices
    grammar: str
    structural_tag: str
    def __init__(self, json_object: _Optional[bool] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("ttft_s", "e2e_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    e2e_s: float
    def __init__(self, ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timing", "logprobs", "stop_reason", "stop_token_id", "prompt_logprobs")
    class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        FINISH_REASON_UNSPECIFIED: _ClassVar[GenerateResponse.FinishReason]
        LENGTH: _ClassVar[GenerateResponse.FinishReason]
        STOP: _ClassVar[GenerateResponse.FinishReason]
        EOS: _ClassVar[GenerateResponse.FinishReason]
        ABORTED: _ClassVar[GenerateResponse.FinishReason]
    FINISH_REASON_UNSPECIFIED: GenerateResponse.FinishReason
    LENGTH: GenerateResponse.FinishReason
    STOP: GenerateResponse.FinishReason
    EOS: GenerateResponse.FinishReason
    ABORTED: GenerateResponse.FinishReason
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: GenerateResponse.FinishReason
    usage: Usage
    timing: Timing
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_reason: str
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[GenerateResponse.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "pipeline", "limits")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    pipeline: PipelineInfo
    limits: RequestLimits
    def __init__(self, model_id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., pipeline: _Optional[_Union[PipelineInfo, _Mapping]] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ...) -> None: ...

class PipelineInfo(_message.Message):
    __slots__ = ("num_stages", "dtype", "quantization", "speculate")
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    num_stages: int
    dtype: str
    quantization: str
    speculate: str
    def __init__(self, num_stages: _Optional[int] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., speculate: _Optional[str] = ...) -> None: ...

class RequestLimits(_message.Message):
    __slots__ = ("max_num_seqs", "max_queue", "max_temperature", "max_logprobs", "max_stop_strings", "max_request_id_chars", "max_seed", "max_logit_bias_entries", "max_stop_token_ids", "max_allowed_token_ids", "max_bad_words", "max_bad_word_chars", "max_logit_bias", "max_structured_output_chars")
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BAD_WORD_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MAX_STRUCTURED_OUTPUT_CHARS_FIELD_NUMBER: _ClassVar[int]
    max_num_seqs: int
    max_queue: int
    max_temperature: float
    max_logprobs: int
    max_stop_strings: int
    max_request_id_chars: int
    max_seed: int
    max_logit_bias_entries: int
    max_stop_token_ids: int
    max_allowed_token_ids: int
    max_bad_words: int
    max_bad_word_chars: int
    max_logit_bias: float
    max_structured_output_chars: int
    def __init__(self, max_num_seqs: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_temperature: _Optional[float] = ..., max_logprobs: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_request_id_chars: _Optional[int] = ..., max_seed: _Optional[int] = ..., max_logit_bias_entries: _Optional[int] = ..., max_stop_token_ids: _Optional[int] = ..., max_allowed_token_ids: _Optional[int] = ..., max_bad_words: _Optional[int] = ..., max_bad_word_chars: _Optional[int] = ..., max_logit_bias: _Optional[float] = ..., max_structured_output_chars: _Optional[int] = ...) -> None: ...
