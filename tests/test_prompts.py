"""Prompt readers on every supported format, the real shared prompt sets, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workflows.config import ConfigError, DataConfig
from workflows.prompts import read_prompts
from tests.conftest import SHARED_DATA

ROWS = [{"id": "x1", "prompt": "a red circle"}, {"id": "x2", "prompt": "  tabs\tand unicode ünïcødé "}]


def write(tmp_path, fmt):
    p = tmp_path / f"prompts.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), p)
    elif fmt == "csv":
        p.write_text('id,prompt\nx1,a red circle\nx2,"  tabs\tand unicode ünïcødé "\n', encoding="utf-8")
    elif fmt == "tsv":
        p.write_text("id\tprompt\nx1\ta red circle\nx2\t  tabs and unicode ünïcødé \n", encoding="utf-8")
    elif fmt == "jsonl":
        p.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    elif fmt == "json":
        p.write_text(json.dumps([r["prompt"] for r in ROWS]), encoding="utf-8")
    return p


@pytest.mark.parametrize("fmt", ["parquet", "csv", "tsv", "jsonl", "json"])
def test_formats(tmp_path, fmt):
    p = write(tmp_path, fmt)
    id_col = None if fmt == "json" else "id"
    rows = read_prompts(DataConfig(name="file", path=str(p), id_column=id_col))
    assert [r["prompt"] for r in rows][0] == "a red circle"
    assert "ünïcødé" in rows[1]["prompt"]
    if id_col:
        assert [r["prompt_id"] for r in rows] == ["x1", "x2"]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "json"])
def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path, fmt):
    """Spreadsheets and Windows editors save UTF-8 with a byte order mark: it is not part of the header's
    first name (a CSV's "prompt" column was not found) nor of a JSON document."""
    p = write(tmp_path, fmt)
    cfg = DataConfig(name="file", path=str(p), id_column=None if fmt == "json" else "id")
    plain = read_prompts(cfg)
    p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    assert read_prompts(cfg) == plain and plain[0]["prompt"] == "a red circle"


def test_a_file_that_is_not_utf8_is_one_line_naming_the_fix(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes("prompt\na red circle\nun cercle rouge foncé\n".encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        read_prompts(DataConfig(name="file", path=str(p)))
    assert str(e.value) == f"data.path={p}: not UTF-8 text (it holds byte 0xe9, e.g. Latin-1): save it as UTF-8"


def test_integer_prompts_are_class_ids_carried_as_digits(tmp_path):
    """A class-conditional prompt set may hold integers (class ids): the job carries them as their digits,
    the text every table's prompt column holds; booleans are not class ids."""
    p = tmp_path / "classes.jsonl"
    p.write_text('{"prompt": 3}\n{"prompt": 207}\n{"prompt": true}\n')
    rows = read_prompts(DataConfig(name="file", path=str(p)))
    assert [r["prompt"] for r in rows] == ["3", "207", True]


def test_derived_ids_are_stable_and_unique(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(["same", "same", "other"]))
    a = read_prompts(DataConfig(name="file", path=str(p)))
    b = read_prompts(DataConfig(name="file", path=str(p)))
    assert [r["prompt_id"] for r in a] == [r["prompt_id"] for r in b]
    assert len({r["prompt_id"] for r in a}) == 3


def test_builtin_shapes_default_and_limit():
    rows = read_prompts(DataConfig())
    assert len(rows) >= 64 and len({r["prompt_id"] for r in rows}) == len(rows)
    assert len(read_prompts(DataConfig(limit=5))) == 5


@pytest.mark.skipif(not (SHARED_DATA / "PartiPrompts.tsv").exists(), reason="shared data not present")
def test_real_prompt_sets_read_as_they_are():
    parti = read_prompts(DataConfig(name="file", path=str(SHARED_DATA / "PartiPrompts.tsv"), prompt_column="Prompt"))
    assert len(parti) == 1632 and parti[0]["prompt"] == "bond"
    assert any('"' in r["prompt"] for r in parti)      # quotes kept verbatim
    coco = read_prompts(DataConfig(name="file", path=str(SHARED_DATA / "coco2017_val_longest_captions.json")))
    assert len(coco) == 5000 and coco[0]["prompt"].startswith("Ma motorcycle")


@pytest.mark.parametrize("setup, message", [
    (lambda d: DataConfig(name="file", path=str(d / "nope.csv")), "data.path=.*no such file"),
    (lambda d: DataConfig(name="file", path=None), "data.path is not set"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.txt", "hi"))), "unknown format"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "bad.parquet", "not parquet"))), "cannot read it"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "bad.json", "{nope"))), "cannot read it"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.csv", "text,x\nhi,1\n")), prompt_column="caption"),
     "data.prompt_column='caption': no such column"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.csv", "a,b\nhi,1\n"))), "data.prompt_column=None"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.csv", "id,prompt\n1,a\n1,b\n")), id_column="id"),
     "duplicate ids"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.csv", "prompt\na\n")), id_column="key"),
     "data.id_column='key': no such column"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.jsonl", '{"id": "a", "prompt": "x"}\n{"prompt": "y"}\n')),
                          id_column="id"), r"data.id_column='id': row 1 of .*p.jsonl has no such field"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.jsonl", '{"id": "a", "prompt": "x"}\n{"id": null, "prompt": "y"}\n')),
                          id_column="id"), r"data.id_column='id': row 1 of .*p.jsonl has an empty id \(None\)"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.csv", "id,prompt\n,x\n")), id_column="id"),
     r"data.id_column='id': row 0 of .*p.csv has an empty id \(''\); give every row an id"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.jsonl", '{"prompt": "x"}\n\n{"prompt": y}\n'))),
     r"data.path=.*p.jsonl: line 3 is not valid JSON .*: fix or remove that line"),
    (lambda d: DataConfig(name="file", path=str(_text(d / "p.jsonl", '{"prompt": "x"}\n["y"]\n'))),
     r"data.path=.*p.jsonl: line 2 is not a JSON object"),
    (lambda d: DataConfig(name="file", path=str(d)), r"data.path=.*: is a directory; point it at a prompt file"),
    (lambda d: DataConfig(name="nope"), "data.name='nope'"),
    (lambda d: DataConfig(limit=-1), "data.limit=-1"),
])
def test_bad_input_is_one_clear_line(tmp_path, setup, message):
    with pytest.raises(ConfigError, match=message) as e:
        read_prompts(setup(tmp_path))
    assert "\n" not in str(e.value)


def _text(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("name, first", [("parti", "bond"), ("coco", "Ma motorcycle")])
def test_parti_and_coco_samples_ship_with_the_package_and_a_full_path_still_works(tmp_path, name, first):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from tests.conftest import REPO
    from workflows.config import register
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        data = OmegaConf.to_object(compose("generate", overrides=[f"data={name}"])).data
        own = tmp_path / "mine.json"
        own.write_text('["x", "y"]')
        mine = OmegaConf.to_object(compose("generate", overrides=["data=coco", f"data.path={own}"])).data
    assert Path(data.path).is_relative_to(REPO / "conf")
    rows = read_prompts(data)
    assert len(rows) == 64 and rows[0]["prompt"].startswith(first)
    assert [r["prompt"] for r in read_prompts(mine)] == ["x", "y"]


@pytest.mark.parametrize("name, text, overrides, message", [
    ("blank.jsonl", "\n\n   \n", [], "holds no prompts (data.limit=None)"),
    ("header.csv", "id,prompt\n", [], "holds no prompts (data.limit=None)"),
    ("header.tsv", "id\tPrompt\n", [], "holds no prompts (data.limit=None)"),
    ("empty.json", "[]", [], "holds no prompts (data.limit=None)"),
    ("p.csv", "prompt\na red circle\n", ["data.limit=0"], "data.limit=0: nothing to generate"),
])
def test_a_prompt_set_with_nothing_to_generate_is_one_line_before_out_dir_is_touched(tmp_path, name, text, overrides,
                                                                                    message):
    """Blank lines only, a header only, an empty list, or data.limit=0: the job stops with one line naming
    data.path (or data.limit) before Ray starts and before out_dir is created."""
    from hydra import compose, initialize_config_dir
    from tests.conftest import REPO
    from workflows.generate import run
    data, out = _text(tmp_path / name, text), tmp_path / "run"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("generate", overrides=["data=file", f"data.path={data}", f"out_dir={out}", *overrides])
    with pytest.raises(ConfigError) as e:
        run(cfg)
    line = str(e.value)
    assert "\n" not in line and message in line, line
    assert line.startswith("data.limit=0" if overrides else f"data.path={data}: "), line
    assert not out.exists()
