"""Tests of the protobuf schema and its committed stubs (``proto/``).

Covers: the committed stubs match what ``proto/speedpipe.proto`` generates (drift check), messages
survive a wire round trip, and every declaration in the schema carries a leading doc comment.
Needs ``grpcio-tools`` (a test dependency) to run protoc.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from proto import generate, speedpipe_pb2, speedpipe_pb2_grpc

# Field numbers in google/protobuf/descriptor.proto, used to build SourceCodeInfo location paths.
_FILE_MESSAGE_TYPE, _FILE_ENUM_TYPE, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED_TYPE, _MESSAGE_ENUM_TYPE, _MESSAGE_ONEOF_DECL = 2, 3, 4, 8
_ENUM_VALUE = 2
_SERVICE_METHOD = 2


# ---------------------------------------------------------------------------------------------------
# Drift check
# ---------------------------------------------------------------------------------------------------


def _copy_committed_stubs(dest_root: Path) -> None:
    for name in generate.GENERATED_FILES:
        (dest_root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(generate.REPO_ROOT / name, dest_root / name)


def test_committed_stubs_match_fresh_generation():
    stale = generate.find_stale()
    assert not stale, generate.stale_message(stale)


@pytest.mark.parametrize("name", generate.GENERATED_FILES)
def test_drift_check_flags_an_edited_stub(tmp_path, name):
    _copy_committed_stubs(tmp_path)
    assert generate.find_stale(tmp_path) == [], "an unmodified copy must not be reported stale"

    edited = tmp_path / name
    edited.write_bytes(edited.read_bytes() + b"\n# hand edit\n")

    assert generate.find_stale(tmp_path) == [name]


def test_drift_check_flags_a_missing_stub(tmp_path):
    _copy_committed_stubs(tmp_path)
    (tmp_path / "proto/speedpipe_pb2.pyi").unlink()

    assert generate.find_stale(tmp_path) == ["proto/speedpipe_pb2.pyi"]


def test_stale_message_names_file_and_regenerate_command():
    message = generate.stale_message(["proto/speedpipe_pb2_grpc.py"])

    assert "proto/speedpipe_pb2_grpc.py" in message
    assert "python -m proto.generate" in message


def test_check_command_exits_zero_on_committed_stubs():
    result = subprocess.run(
        [sys.executable, "-m", "proto.generate", "--check"],
        cwd=generate.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_grpc_stub_imports_messages_from_proto_package():
    assert speedpipe_pb2_grpc.proto_dot_speedpipe__pb2 is speedpipe_pb2
    assert speedpipe_pb2.DESCRIPTOR.package == "speedpipe.v1"


# ---------------------------------------------------------------------------------------------------
# Wire round trips
# ---------------------------------------------------------------------------------------------------


def test_generate_request_round_trip_with_token_ids():
    request = speedpipe_pb2.GenerateRequest(
        request_id="req-1",
        prompt_token_ids=speedpipe_pb2.TokenIds(ids=[1, 15043, 3186]),
        max_new_tokens=32,
        temperature=0.7,
        top_p=0.9,
        seed=2**64 - 1,
        stop=["\n\n", "</s>"],
        ignore_eos=True,
    )

    decoded = speedpipe_pb2.GenerateRequest.FromString(request.SerializeToString())

    assert decoded == request
    assert decoded.WhichOneof("input") == "prompt_token_ids"
    assert list(decoded.prompt_token_ids.ids) == [1, 15043, 3186]
    assert decoded.HasField("seed") and decoded.seed == 2**64 - 1
    assert decoded.temperature == pytest.approx(0.7)
    assert list(decoded.stop) == ["\n\n", "</s>"]


def test_generate_request_round_trip_with_text_and_no_seed():
    request = speedpipe_pb2.GenerateRequest(request_id="req-2", prompt="Hello", max_new_tokens=4)

    decoded = speedpipe_pb2.GenerateRequest.FromString(request.SerializeToString())

    assert decoded.WhichOneof("input") == "prompt"
    assert decoded.prompt == "Hello"
    assert not decoded.HasField("seed"), "an unset optional seed must stay distinguishable from 0"


def test_generate_request_prompt_oneof_keeps_only_the_last_set():
    request = speedpipe_pb2.GenerateRequest(prompt="Hello")
    request.prompt_token_ids.ids.extend([1, 2])

    assert request.WhichOneof("input") == "prompt_token_ids"
    assert request.prompt == ""


def test_load_stage_request_round_trip():
    request = speedpipe_pb2.LoadStageRequest(
        model_dir="/models/tiny",
        stage_index=1,
        num_stages=2,
        layer_start=11,
        layer_stop=22,
        dtype="bfloat16",
        device="cuda:1",
        max_num_seqs=8,
        max_model_len=2048,
        num_threads=4,
        dist_rank=1,
        dist_world_size=3,
        dist_master_addr="127.0.0.1",
        dist_master_port=29500,
        stage_timeout_s=30.5,
        exit_layer=-1,
    )

    decoded = speedpipe_pb2.LoadStageRequest.FromString(request.SerializeToString())

    assert decoded == request
    assert decoded.exit_layer == -1
    assert decoded.stage_timeout_s == 30.5
    assert (decoded.layer_start, decoded.layer_stop) == (11, 22)


def test_removed_load_fields_are_reserved_so_their_numbers_are_never_reused():
    message = descriptor_pb2.DescriptorProto()
    speedpipe_pb2.LoadStageRequest.DESCRIPTOR.CopyToProto(message)
    assert {"dist_backend", "predictor"} <= set(message.reserved_name)
    assert {15, 18} <= {r.start for r in message.reserved_range}
    assert not {"dist_backend", "predictor"} & set(speedpipe_pb2.LoadStageRequest.DESCRIPTOR.fields_by_name)


def test_last_generate_response_round_trip_carries_usage_and_timing():
    response = speedpipe_pb2.GenerateResponse(
        request_id="req-1",
        token_ids=[2],
        text="",
        finish_reason=speedpipe_pb2.GenerateResponse.EOS,
        usage=speedpipe_pb2.Usage(prompt_tokens=3, completion_tokens=7),
        timing=speedpipe_pb2.Timing(ttft_s=0.125, e2e_s=1.5),
    )

    decoded = speedpipe_pb2.GenerateResponse.FromString(response.SerializeToString())

    assert decoded == response
    assert decoded.HasField("usage") and decoded.HasField("timing")
    assert decoded.finish_reason == speedpipe_pb2.GenerateResponse.FinishReason.EOS


def test_unfinished_generate_response_defaults_to_unspecified_without_usage():
    response = speedpipe_pb2.GenerateResponse(request_id="req-1", token_ids=[42], text="hi")

    decoded = speedpipe_pb2.GenerateResponse.FromString(response.SerializeToString())

    assert decoded.finish_reason == speedpipe_pb2.GenerateResponse.FINISH_REASON_UNSPECIFIED
    assert not decoded.HasField("usage")
    assert not decoded.HasField("timing")


def test_services_expose_the_documented_rpcs():
    services = speedpipe_pb2.DESCRIPTOR.services_by_name

    assert [m.name for m in services["StageService"].methods] == [
        "Load",
        "Health",
        "GetStats",
        "Reset",
        "Shutdown",
        "Rejoin",
    ]
    assert [m.name for m in services["GenerateService"].methods] == ["Generate", "Health", "GetModelInfo"]
    generate_rpc = services["GenerateService"].methods_by_name["Generate"]
    assert generate_rpc.output_type.name == "GenerateResponse"
    assert services["GenerateService"].methods_by_name["GetModelInfo"].output_type.name == "ModelInfo"


# ---------------------------------------------------------------------------------------------------
# Doc comments
# ---------------------------------------------------------------------------------------------------


def _undocumented_declarations(file_proto) -> list[str]:
    """Names of services, RPCs, messages, fields, oneofs, enums and enum values without a leading
    ``//`` comment directly above them (a comment separated by a blank line does not count).

    Args:
        file_proto: a ``FileDescriptorProto`` parsed by protoc with ``--include_source_info``.
    """
    leading = {tuple(loc.path): loc.leading_comments.strip() for loc in file_proto.source_code_info.location}
    missing: list[str] = []

    def check(path: tuple[int, ...], qualified_name: str) -> None:
        if not leading.get(path):
            missing.append(qualified_name)

    def walk_enum(enum, path, prefix):
        check(path, f"{prefix}{enum.name}")
        for i, value in enumerate(enum.value):
            check((*path, _ENUM_VALUE, i), f"{prefix}{enum.name}.{value.name}")

    def walk_message(message, path, prefix):
        name = f"{prefix}{message.name}"
        check(path, name)
        synthetic_oneofs = {f.oneof_index for f in message.field if f.proto3_optional}
        for i, oneof in enumerate(message.oneof_decl):
            if i not in synthetic_oneofs:
                check((*path, _MESSAGE_ONEOF_DECL, i), f"{name}.{oneof.name}")
        for i, field in enumerate(message.field):
            check((*path, _MESSAGE_FIELD, i), f"{name}.{field.name}")
        for i, nested in enumerate(message.nested_type):
            if not nested.options.map_entry:  # a map field's entry type: protoc writes it, it has no source
                walk_message(nested, (*path, _MESSAGE_NESTED_TYPE, i), f"{name}.")
        for i, enum in enumerate(message.enum_type):
            walk_enum(enum, (*path, _MESSAGE_ENUM_TYPE, i), f"{name}.")

    for i, service in enumerate(file_proto.service):
        check((_FILE_SERVICE, i), service.name)
        for j, method in enumerate(service.method):
            check((_FILE_SERVICE, i, _SERVICE_METHOD, j), f"{service.name}.{method.name}")
    for i, message in enumerate(file_proto.message_type):
        walk_message(message, (_FILE_MESSAGE_TYPE, i), "")
    for i, enum in enumerate(file_proto.enum_type):
        walk_enum(enum, (_FILE_ENUM_TYPE, i), "")
    return missing


def test_every_declaration_in_speedpipe_proto_has_a_doc_comment():
    file_proto = generate.compile_descriptor()

    missing = _undocumented_declarations(file_proto)

    assert not missing, f"add a leading // comment in {generate.PROTO_FILE} to: {', '.join(missing)}"
    assert len(file_proto.message_type) > 0 and len(file_proto.service) == 2


def test_doc_comment_check_names_undocumented_field(tmp_path):
    (tmp_path / "bad.proto").write_text(
        'syntax = "proto3";\n'
        "package bad.v1;\n"
        "// A service.\n"
        "service S {\n"
        "  // An RPC.\n"
        "  rpc Do(Req) returns (Req);\n"
        "}\n"
        "// A request.\n"
        "message Req {\n"
        "  // Documented.\n"
        "  int32 documented_ns = 1;\n"
        "  int32 undocumented_ns = 2;  // a trailing comment is not a doc comment\n"
        "  // Detached by a blank line, so not a doc comment either.\n"
        "\n"
        "  int32 detached_bytes = 3;\n"
        "  enum Kind {\n"
        "    // Documented value.\n"
        "    KIND_UNSPECIFIED = 0;\n"
        "  }\n"
        "}\n"
    )

    file_proto = generate.compile_descriptor(include_root=tmp_path, proto_file="bad.proto")

    assert _undocumented_declarations(file_proto) == [
        "Req.undocumented_ns",
        "Req.detached_bytes",
        "Req.Kind",
    ]
