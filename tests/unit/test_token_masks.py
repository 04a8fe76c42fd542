"""vLLM's token masks (pipeline/speculation/masks/token_masks.py): settings, tokenising bad words, verify's
stop at a stop token id, and the request handle's text (stop strings after min_tokens, a stop token's text).

What breaks when these fail: a bad min_tokens / stop_token_ids / allowed_token_ids / bad_words is accepted
or refused without naming the field; an id outside the vocabulary reaches the model; bad words are
tokenised unlike vLLM (the leading-space variant missing or wrongly added); a FIRP chain or jump-forward
run commits past a stop token id; a stop string ends the output inside the first min_tokens tokens' text
(vLLM's detokenizer ignores those matches), or one that started in text already streamed is missed or
cut wrongly with include_stop_str_in_output, or streaming in commits of several tokens shows other text than
vLLM's token-by-token detokenizer; a stop token id's or EOS's text is shown (or not shown with
include_stop_str_in_output), or its id is not the `stop_reason`. Engine exactness on every speculative path:
tests/unit/test_token_masks_paths.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from launcher.cli.errors import flag_message
from launcher.cli.main import _parse, build_parser, main, sampling_params
from launcher.coordinator.request_handle import RequestHandle, TextOptions, encode_prompt
from pipeline.engine.records import Commit, FinishReason
from pipeline.model.tokenizer import Tokenizer
from pipeline.speculation.grammar import GrammarError, GrammarSpec, GrammarState, GrammarVocab
from pipeline.speculation.masks.token_masks import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_STOP_TOKEN_IDS,
    bad_word_token_ids,
)
from pipeline.speculation.sampling import Sampler, SamplingParamError, SamplingParams
from pipeline.speculation.verify import verify_result
from pipeline.weights.gguf_import import open_gguf, tokenizer_from_gguf
from pipeline.weights.registry import DEFAULT_MODEL, registered_gguf_path
from tests.tiny_model import NUM_BYTE_TOKENS, TINY_EOS_ID, byte_tokenizer, write_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir) -> Tokenizer:
    return Tokenizer(tiny_dir)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("min_tokens", -1, r"min_tokens must be an integer in \[0, max_tokens = 8\], got -1"),
    ("min_tokens", 9, "got 9"), ("min_tokens", 1.5, "got 1.5"), ("min_tokens", True, "got True"),
    ("stop_token_ids", "2", "stop_token_ids must be a list of token ids, got str"),
    ("stop_token_ids", [-1], r"stop_token_ids must hold token ids \(integers >= 0\), got -1"),
    ("stop_token_ids", [2.0], "got 2.0"), ("stop_token_ids", [True], "got True"),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1)), f"301 entries; at most {MAX_STOP_TOKEN_IDS}"),
    ("allowed_token_ids", [], r"allowed_token_ids must not be empty \(null: every token\)"),
    ("allowed_token_ids", ["1"], "got '1'"),
    ("allowed_token_ids", list(range(MAX_ALLOWED_TOKEN_IDS + 1)), f"at most {MAX_ALLOWED_TOKEN_IDS}"),
    ("bad_words", "word", "bad_words must be a list of strings, got str"),
    ("bad_words", [""], "bad_words must hold non-blank strings of at most 200 characters, got ''"),
    ("bad_words", ["  "], "got '  '"), ("bad_words", [7], "got 7"),
    ("bad_words", ["x" * (MAX_BAD_WORD_CHARS + 1)], r"got 'xxx.*… \(203 characters\)"),
    ("bad_words", ["w"] * (MAX_BAD_WORDS + 1), f"101 entries; at most {MAX_BAD_WORDS}"),
])
def test_bad_settings_are_refused_naming_the_field(field, value, match):
    with pytest.raises(SamplingParamError, match=match) as info:
        SamplingParams(max_new_tokens=8, **{field: value})
    assert info.value.param == field and str(info.value).startswith(field)


def test_settings_are_kept_as_tuples_without_repeats():
    p = SamplingParams(min_tokens=3, stop_token_ids=[7, 2, 7], allowed_token_ids=[9, 1, 9], bad_words=["a", "b"])
    assert (p.stop_token_ids, p.allowed_token_ids, p.bad_words) == ((7, 2), (1, 9), ("a", "b"))
    assert SamplingParams(max_new_tokens=4, min_tokens=4).min_tokens == 4  # min_tokens == max_tokens is allowed
    assert not SamplingParams(stop_token_ids=(2,)).needs_logits_at(0)  # a stop id alone changes no logits
    for masks in (dict(min_tokens=1), dict(allowed_token_ids=(1,)), dict(bad_word_ids=((5,),))):
        assert SamplingParams(**masks).needs_logits_at(0), masks  # a greedy masked request ships its logits rows


@pytest.mark.parametrize(("field", "masks"), [("stop_token_ids", dict(stop_token_ids=(3, 9))),
                                              ("allowed_token_ids", dict(allowed_token_ids=(9,))),
                                              ("bad_words", dict(bad_word_ids=((1, 9),)))])
def test_token_ids_are_checked_against_the_vocabulary(field, masks):
    params = SamplingParams(**masks)
    params.check_vocab(10)
    with pytest.raises(SamplingParamError, match=rf"{field} token id 9 is outside the vocabulary \[0, 9\)") as info:
        params.check_vocab(9)
    assert info.value.param == field


def test_bad_words_tokenise_as_vllm_with_the_leading_space_variant():
    """vLLM's SamplingParams.update_from_tokenizer: the word (leading whitespace stripped), and " " + word
    only when that starts with another token and has as many tokens."""
    vocab = {"cat": [10], " cat": [11], "dog": [20], " dog": [20], "big cat": [30, 11], " big cat": [31, 11],
             "zebra": [40, 41], " zebra": [42, 40, 41]}
    assert bad_word_token_ids(["cat", " dog", "big cat", "  zebra"], vocab.__getitem__) == (
        (10,), (11,), (20,), (30, 11), (31, 11), (40, 41))
    with pytest.raises(SamplingParamError, match="encodes to no token"):
        bad_word_token_ids(["x"], lambda text: [])


def _vllm_bad_word_ids(words: list[str], hf) -> tuple[tuple[int, ...], ...]:
    """vLLM's SamplingParams.update_from_tokenizer, written out, on a transformers tokenizer `hf`."""
    out: list[list[int]] = []
    for word in words:
        for add_prefix_space in (False, True):
            ids = hf.encode(text=(" " if add_prefix_space else "") + word.lstrip(), add_special_tokens=False)
            if not add_prefix_space or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return tuple(tuple(ids) for ids in out)


def test_bad_words_tokenise_as_vllm_on_the_default_models_bpe_tokenizer(tmp_path):
    """The default model's byte-level BPE (SmolLM2, no prefix space: "cat" and " cat" are different tokens): the
    coordinator's sequences are vLLM's rule on transformers' tokenizer of the same tokenizer.json, the spaced
    variant included where it has as many tokens, dropped where not; a special token's text is that token."""
    transformers = pytest.importorskip("transformers")
    try:
        path = registered_gguf_path(DEFAULT_MODEL)
    except ValueError as err:
        pytest.skip(str(err))
    tok = tokenizer_from_gguf(open_gguf(path))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    words = ["cat", " cat", "Paris", "hello world", "  dog", "unbelievable", "\nnew", "é", "日本", "<|im_end|>", "a b"]
    ours = Tokenizer(tmp_path)
    got = bad_word_token_ids(words, lambda w: ours.encode(w, add_special_tokens=False))
    want = _vllm_bad_word_ids(words, hf)
    assert got == want
    assert len(want) > len(words) and any(len(w) > 1 for w in want), "no spaced variant or no multi-token word"


def test_the_coordinator_tokenises_bad_words_with_the_models_tokenizer(tokenizer):
    params = SamplingParams(max_new_tokens=4, bad_words=("ab", "c"))
    _, _, got = encode_prompt(tokenizer, "Hi", params, max_model_len=64)
    want = []
    for word in ("ab", "c"):  # the byte tokenizer: " ab" has a token more, so no spaced variant
        want.append(tuple(tokenizer.encode(word, add_special_tokens=False)))
    assert got.bad_word_ids == tuple(want) and got.bad_words == params.bad_words


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_chain_never_commits_past_a_stop_token_id(ignore_eos):
    """A FIRP chain (or a jump-forward run) whose accepted drafts run through a stop id ends there,
    as token-by-token decoding does (greedy, no logits: the stop id alone changes no row)."""
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(4,), ignore_eos=ignore_eos)
    got = verify_result(argmax=[3, 4, 5, 6], drafts=[3, 4, 5, 6], logits=None, sampler=Sampler(params),
                        eos_token_ids=(2,), ignore_eos=ignore_eos, budget_left=8)
    assert got == [3, 4]


def test_masks_that_leave_no_token_fail_the_request_naming_them():
    params = SamplingParams(max_new_tokens=8, min_tokens=2, allowed_token_ids=(2,))
    with pytest.raises(GrammarError, match="allowed_token_ids, min_tokens leave no token to generate at output token 0") as info:
        verify_result(argmax=[2], drafts=[], logits=torch.zeros(1, 6), sampler=Sampler(params),
                      eos_token_ids=(2,), ignore_eos=False, budget_left=8)
    assert info.value.tokens == () and info.value.fields == ("allowed_token_ids", "min_tokens")


def _emit(tokenizer, params: SamplingParams, ids: list[int], *, one_commit: bool, last: FinishReason) -> RequestHandle:
    h = RequestHandle("r", "p", [1], params, tokenizer.detokenizer(prompt_ids=[1]))
    commits = [tuple(ids)] if one_commit else [(t,) for t in ids]
    for i, c in enumerate(commits):
        if h.emit(Commit(0, c, last if i == len(commits) - 1 else None)):
            break
    return h


@pytest.mark.parametrize("one_commit", [False, True])
@pytest.mark.parametrize(("text", "stop", "min_tokens"), [
    ("is Lee, and I'm a student", ("e",), 0), ("is Lee, and I'm a student", ("e",), 5),
    ("is Lee, and I'm a student", ("e",), 6), ("is Lee, and I'm a student", ("Lee", "stu"), 3),
    ("is Lee, and I'm a student", ("Lee", "stu"), 5), ("abcabc", ("bc",), 2), ("abcabc", ("bc",), 6),
])
def test_stop_strings_end_nothing_inside_the_first_min_tokens_tokens(tokenizer, text, stop, min_tokens, one_commit):
    """vLLM's detokenizer (vllm-project/vllm#22014, tests/detokenizer/test_min_tokens.py): a stop string
    counts only where its match ends in the text after the first min_tokens tokens (byte tokenizer: one
    token per character). The reference: the first match ending past that text, by str.find."""
    ids = tokenizer.encode(text)
    ends = [(i + len(s), i, s) for s in stop for i in range(len(text)) if text.startswith(s, i)
            and i + len(s) > min_tokens]
    want_text, want_reason = (text[:min(ends)[1]], min(ends)[2]) if ends else (text, None)
    params = SamplingParams(max_new_tokens=len(ids), stop=stop, min_tokens=min_tokens)
    h = _emit(tokenizer, params, ids, one_commit=one_commit, last=FinishReason.LENGTH)
    assert (h.result(1).text, h.stop_reason) == (want_text, want_reason)
    assert h.finish_reason == ("stop" if ends else "length")


@pytest.mark.parametrize("one_commit", [False, True])
def test_a_stop_token_ids_text_is_not_shown_and_it_is_the_stop_reason(tokenizer, one_commit):
    """vLLM: the stop token is in the output tokens, its text is not in the output text (as EOS), and
    `stop_reason` is its id; a stop string completed before it ends the output first."""
    ids = tokenizer.encode("abc!")
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(ids[-1],))
    h = _emit(tokenizer, params, ids, one_commit=one_commit, last=FinishReason.STOP)
    chunks = list(h)
    assert (h.result(1).text, h.token_ids, h.finish_reason) == ("abc", ids, "stop")
    assert h.stop_reason == chunks[-1].stop_reason == ids[-1]
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(ids[-1],), stop=("bc",))
    h = _emit(tokenizer, params, ids, one_commit=one_commit, last=FinishReason.STOP)
    assert (h.result(1).text, h.stop_reason, h.token_ids) == ("a", "bc", ids[:3])



def _vllm_detokenizer(tok, ids: list[int], *, stop: tuple[str, ...], min_tokens: int, include: bool,
                      stop_terminated: bool) -> tuple[list[int], str, str | None, list[str]]:
    """vLLM's v1 detokenizer fed one token per step (token-by-token decoding), written out from
    vllm/v1/engine/detokenizer.py (`BaseIncrementalDetokenizer.update`: a stop-terminated request's last token
    is not decoded unless include_stop_str_in_output; `stop_check_offset` past the first min_tokens tokens'
    text; `get_next_output_text`: the last max(len(stop)) - 1 characters held back unless include) and its
    `check_stop_strings` (a match counts only where it ends in the new text; the first listed wins, one token's
    text being one character here; cut at its start or, included, its end). Each token's text: the `tokenizers`
    library's decode of the ids so far less that of the ids before it. (ids kept, final text, stop string,
    streamed deltas)."""
    text, deltas, offset = "", [], 0
    buffer = max(len(s) for s in stop) - 1 if stop and not include else 0
    for n in range(1, len(ids) + 1):
        last = n == len(ids)
        stop_check_offset = len(text)
        if not (last and stop_terminated and not include):
            text += tok.decode(ids[:n], skip_special_tokens=False)[len(tok.decode(ids[:n - 1], skip_special_tokens=False)):]
            if min_tokens and n <= min_tokens:
                stop_check_offset = len(text)
        hit, new_chars = None, len(text) - stop_check_offset
        for s in stop if stop and n > min_tokens and new_chars else ():
            if (i := text.find(s, 1 - new_chars - len(s))) >= 0:
                hit, text = s, text[:i + len(s) if include else i]
                break
        end = len(text) - (0 if last or hit else buffer)
        deltas.append(text[offset:end] if offset < end else "")
        offset = max(offset, end)
        if hit:
            return ids[:n], text, hit, deltas
    return ids, text, None, deltas


STREAM_CASES = [("abXYZcdXYZef", ("XYZ",)), ("aYZbcYZd", ("YZ", "QQQQ")), ("hello world, hello there", ("lo", "o t")),
                ("aaaaaa", ("aa",)), ("xabcabcdab", ("abcd", "bc")), ("abcdef", ("cdef", "de"))]


@pytest.mark.parametrize(("text", "stop"), STREAM_CASES)
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("ending", [FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP])
def test_stop_strings_after_min_tokens_stream_as_vllm_in_every_commit_size(tokenizer, text, stop, include, ending):
    """min_tokens + stop strings + include_stop_str_in_output both ways + the EOS / stop token id that ends
    the request, fed in commits of 1, 2, 3, 5 tokens and all at once (FIRP chains, jump-forward runs): the
    tokens kept, the text, the stop reason and what has streamed after each commit are vLLM's token-by-token
    detokenizer's (`_vllm_detokenizer`) at that commit's last token. Covers a stop string that starts in
    text already streamed (include) and one that lies wholly inside the first min_tokens tokens' text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids += {FinishReason.LENGTH: [], FinishReason.EOS: [TINY_EOS_ID], FinishReason.STOP: [ord("!")]}[ending]
    options = TextOptions(skip_special_tokens=False, include_stop_str_in_output=include)
    for min_tokens in range(len(ids) + (ending is FinishReason.LENGTH)):  # an EOS / stop id comes after min_tokens
        want_ids, want_text, want_stop, deltas = _vllm_detokenizer(
            tokenizer._tok, ids, stop=stop, min_tokens=min_tokens, include=include,
            stop_terminated=ending is not FinishReason.LENGTH)
        if want_stop is None and ending is FinishReason.STOP:
            want_stop = ids[-1]  # vLLM's stop_reason: the stop token id
        for size in (1, 2, 3, 5, len(ids)):
            params = SamplingParams(max_new_tokens=len(ids), stop=stop, min_tokens=min_tokens,
                                    stop_token_ids=(ord("!"),) if ending is FinishReason.STOP else ())
            h = RequestHandle("r", "p", [1], params, options.detokenizer(tokenizer, [1]), options)
            commits = [tuple(ids[i:i + size]) for i in range(0, len(ids), size)]
            for j, c in enumerate(commits):
                if h.emit(Commit(0, c, ending if j == len(commits) - 1 else None)):
                    break
            streamed = list(itertools.accumulate(c.text for c in h))
            case = (min_tokens, size)
            assert (h.token_ids, h.result(1).text, h.stop_reason) == (want_ids, want_text, want_stop), case
            assert streamed == ["".join(deltas[:min((j + 1) * size, len(want_ids))])
                                for j in range(-(-len(want_ids) // size))], case
            assert h.finish_reason == ("stop" if want_stop is not None else ending.value), case


def test_launch_flags_reach_the_sampling_params_and_bad_values_exit_2(capsys, tiny_dir):
    args = _parse(build_parser(), ["launch", "--min-tokens", "3", "--stop-token-ids", "2, 13", "--allowed-token-ids",
                                   "5,6,7", "--bad-words", "foo", "--bad-words", "bar baz"])
    p = sampling_params(args)
    assert (p.min_tokens, p.stop_token_ids, p.allowed_token_ids, p.bad_words) == (3, (2, 13), (5, 6, 7),
                                                                                   ("foo", "bar baz"))
    with pytest.raises(SystemExit) as info:
        main(["launch", "--stop-token-ids", "2,x"])
    assert info.value.code == 2 and "argument --stop-token-ids: must be comma-separated token ids" in capsys.readouterr().err
    with pytest.raises(ValueError) as err:
        sampling_params(_parse(build_parser(), ["launch", "--max-new-tokens", "4", "--min-tokens", "5"]))
    assert flag_message(str(err.value)) == "--min-tokens must be an integer in [0, max_tokens = 4], got 5"
    for flags, needle in ((["--allowed-token-ids", "256"], "--allowed-token-ids token id 256 is outside the vocabulary"),
                          (["--bad-words", " "], "--bad-words must hold non-blank strings"),
                          (["--max-new-tokens", "2", "--min-tokens", "3"], "--min-tokens must be an integer"),
                          # every allowed id masked at the first token: refused before the stages are spawned
                          (["--allowed-token-ids", f"{TINY_EOS_ID}", "--min-tokens", "1"],
                           "--allowed-token-ids leave no token to generate"),
                          (["--allowed-token-ids", "104", "--bad-words", "h"], "--allowed-token-ids leave no token")):
        assert main(["launch", "--model", str(tiny_dir), "--prompt", "hi", *flags]) == 2
        err_text = capsys.readouterr().err
        assert needle in err_text and len(err_text.strip().splitlines()) == 1, err_text


def test_masks_and_a_grammar_that_together_leave_no_token_fail_the_request():
    """The grammar allows only "a"; bad_words bans it: the row has no token left (not a silent argmax of -inf)."""
    spec = GrammarSpec.choice(["a"])
    state = GrammarState(spec, GrammarVocab(byte_tokenizer().to_str(), eos_token_ids=[TINY_EOS_ID]))
    params = SamplingParams(max_new_tokens=4, grammar=spec, bad_word_ids=((ord("a"),),))
    with pytest.raises(GrammarError, match="bad_words, response_format leave no token") as info:
        verify_result(argmax=[ord("a")], drafts=[], logits=torch.zeros(1, NUM_BYTE_TOKENS), sampler=Sampler(params),
                      eos_token_ids=(TINY_EOS_ID,), ignore_eos=False, budget_left=4, grammar=state)
    assert info.value.fields == ("bad_words", "response_format")
