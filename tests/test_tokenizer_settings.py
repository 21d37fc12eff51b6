"""``attnx.tokenizer`` read once, into :class:`attnx.contract.TokenizerSettings` (issue 47 item 5).

Every reader (serving's tokenizer, the batcher's pad id, Triton's tokenizer model, the explain page, the export's
own tokenizer) takes the typed settings; the checks and their one-line errors live in the contract. attnx 0.1's
files (tests/data/legacy-0.1) read the same and write back byte for byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from attnx.contract import ContractError, ModelInfo, TokenizerSettings

LEGACY = Path(__file__).parent / "data" / "legacy-0.1" / "exports"
GOOD = {"dir": "m.tokenizer", "file": "tokenizer.json", "max_length": 64, "truncation_side": "left", "pad_id": 3,
        "model_type": "bert"}


def test_legacy_files_read_into_the_type_and_write_back_unchanged():
    for path in sorted(LEGACY.glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        raw = {p.key: p.value for p in model.metadata_props}["attnx.tokenizer"]
        info = ModelInfo.read(model)
        assert isinstance(info.tokenizer, TokenizerSettings)
        assert (info.tokenizer.dir, info.tokenizer.max_length, info.tokenizer.pad_id) == (f"{path.stem}.tokenizer", 64, 0)
        assert json.loads(info.to_props()["attnx.tokenizer"]) == json.loads(raw)
        assert info.tokenizer.path(path.parent) == (path.parent / f"{path.stem}.tokenizer" / "tokenizer.json").resolve()


def test_settings_keep_unknown_keys_and_defaults():
    s = TokenizerSettings.from_metadata({"dir": "t", "max_length": 8, "future": [1, 2]})
    assert (s.file, s.truncation_side, s.pad_id, s.model_type) == ("tokenizer.json", "right", 0, None)
    assert s.to_json() == {"dir": "t", "file": "tokenizer.json", "max_length": 8, "truncation_side": "right",
                           "pad_id": 0, "future": [1, 2]}
    assert TokenizerSettings.from_metadata(TokenizerSettings.from_metadata(GOOD).to_json()).to_json() == GOOD


BAD = {
    "no-max-length": ({"dir": "t"}, "has no max_length"),  # the old explain reader guessed 512 here
    "no-dir": ({"max_length": 8}, "has no dir"),
    "max-length-text": ({**GOOD, "max_length": "64"}, "max_length '64' is not an integer"),
    "max-length-bool": ({**GOOD, "max_length": True}, "max_length True is not an integer"),
    "max-length-zero": ({**GOOD, "max_length": 0}, "max length 0 must be at least 1"),
    "pad-id-text": ({**GOOD, "pad_id": "0"}, "pad_id '0' is not an integer"),
    "pad-id-negative": ({**GOOD, "pad_id": -1}, "pad id -1 is outside"),
    "side": ({**GOOD, "truncation_side": "middle"}, "truncation_side 'middle' must be left or right"),
    "empty-dir": ({**GOOD, "dir": ""}, "dir '' is not a folder name"),
    "not-object": ([1, 2], "is not an object"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_settings_are_one_line_contract_errors(case):
    meta, message = BAD[case]
    with pytest.raises(ContractError) as err:
        TokenizerSettings.from_metadata(meta)
    assert message in str(err.value) and "\n" not in str(err.value)
    # the same check when a file's metadata is read
    props = {"attnx.variant": "none", "attnx.tokenizer": json.dumps(meta)}
    with pytest.raises(ContractError, match=message.split(" ")[0]):
        ModelInfo.from_props(props)


def test_a_tokenizer_folder_outside_the_export_is_refused(tmp_path):
    s = TokenizerSettings.from_metadata({**GOOD, "dir": "../elsewhere"})
    with pytest.raises(ContractError, match="points outside"):
        s.path(tmp_path / "export")


def test_every_reader_takes_the_same_settings(tmp_path):
    """The export's tokenizer (calibration, parity), serving's tokenizer and Triton's tokenization agree on the
    settings of one file, a legacy export whose truncation side is changed to left to tell defaults apart."""
    from attnx.deploy.text_ensemble import Tokenization
    from attnx.export.tokenizer import ExportTokenizer
    from attnx.runtime.core.text import TextTokenizer

    src = LEGACY / "bert-smal.onnx"
    shutil.copytree(src.with_suffix(".tokenizer"), tmp_path / "bert-smal.tokenizer")
    model = onnx.load(str(src), load_external_data=False)
    info = ModelInfo.read(model)
    info.tokenizer = TokenizerSettings.from_metadata({**info.tokenizer.to_json(), "truncation_side": "left",
                                                      "max_length": 16, "pad_id": 2})
    info.write(model)
    path = tmp_path / src.name
    onnx.save(model, str(path))
    info = ModelInfo.read(path)

    serving = TextTokenizer.from_export(path, info)
    exported = ExportTokenizer(path, info)
    triton = Tokenization.from_metadata(info.tokenizer)
    assert (serving.max_length, serving.truncation_side, serving.pad_id) == (16, "left", 2)
    assert (exported.max_length, exported.side, exported.pad_id) == (16, "left", 2)
    assert (triton.max_length, triton.truncation_side, triton.pad_id, triton.file) == (16, "left", 2, "tokenizer.json")
    long_text = " ".join(["word"] * 40)
    served = serving.tokenize([long_text])[0]
    assert served.truncated and served.length == 16
    assert list(served.ids) == list(exported.encode([long_text])[0].ids)
