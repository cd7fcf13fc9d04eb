"""``data.split`` on a small data set: a part that nothing reads (the test part; the validation
part when the run does not evaluate) may be empty and is not built; a part that is read and
would be empty is one line with the numbers and a split that works."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybrid.data import DataError, validate_data
from hybrid.data.prepare import Request, prepare_data
from hybrid.data.documents import ReadOptions
from hybrid.data.sources import indexed_spec
from hybrid.planning.config import DataConfig, EvalConfig, ModelConfig, TrainConfig
from hybrid.planning.data_sources import read_parts, split_documents, working_split

TRAIN = str(Path(sys.executable).parent / "hybrid-train")
EVAL = EvalConfig(every=1)
QUIET = EvalConfig(every=0, at_end=False)

pytestmark = pytest.mark.timeout(300)


def indexed(folder: Path, name: str, documents: int) -> str:
    """An indexed data set of ``documents`` short generated documents."""
    text = folder / f"{name}.txt"
    text.write_text("\n\n".join(f"document {i}: " + "words and more words " * (i % 7 + 1)
                                for i in range(documents)))
    prepare_data(Request(inputs=[str(text)], output=str(folder / name), format="indexed",
                         read=ReadOptions(documents="blank-lines"), progress=False))
    return str(folder / name)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("splits")
    return {n: indexed(folder, f"docs{n}", n) for n in (1, 5, 200)}


def check(path=None, split=(969, 30, 1), eval_cfg=QUIET, blend=None):
    data = DataConfig(source="indexed", path=path, blend=blend, split=list(split))
    return validate_data(data, ModelConfig(vocab=256), TrainConfig(), eval_cfg)


def test_the_default_split_of_200_documents_trains_and_evaluates(sets):
    assert split_documents([969, 30, 1], 200) == (194, 6, 0)  # an empty test part
    check(sets[200], eval_cfg=QUIET)
    check(sets[200], eval_cfg=EVAL)
    check(sets[5], eval_cfg=QUIET)  # 5 documents, all of them train: nothing reads the rest


@pytest.mark.parametrize("name, split, eval_cfg, message", [
    ("validation read", [999, 1, 0], EVAL,
     "data.split=[999,1,0] leaves the validation part of {d200} empty: its 200 documents split "
     "train 200, validation 0, test 0; use data.split=[199,1,0], or evaluate nothing "
     "(eval.every=0 eval.at_end=false)"),
    ("no eval config", [999, 1, 0], None, "use data.split=[199,1,0], or evaluate nothing"),
    ("train empty", [1, 999, 0], QUIET,
     "data.split=[1,999,0] leaves the train part of {d200} empty: its 200 documents split "
     "train 0, validation 200, test 0; use data.split=[1,0,0]"),
    ("one document", [969, 30, 1], EVAL,
     "leaves the validation part of {d1} empty: its 1 document splits train 1, validation 0, "
     "test 0; use more documents (a train and a validation part need 2 or more), or evaluate "
     "nothing"),
])
def test_a_part_that_is_read_and_empty_is_one_line_with_a_split_that_works(
        sets, name, split, eval_cfg, message):
    path = sets[1] if name == "one document" else sets[200]
    with pytest.raises(DataError) as refused:
        check(path, split, eval_cfg)
    assert message.format(d1=sets[1], d200=sets[200]) in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_suggested_split_passes_for_every_data_set_of_a_blend(sets):
    blend = [0.5, sets[5], 0.5, sets[200]]
    with pytest.raises(DataError, match=r"use data.split=\[4,1,0\]"):
        check(split=[969, 30, 1], eval_cfg=EVAL, blend=blend)
    check(split=[4, 1, 0], eval_cfg=EVAL, blend=blend)
    for smallest in range(2, 40):
        for read in ((True, True, False), (True, False, False)):
            split = working_split([smallest, 3 * smallest + 1, 1000], read)
            for count in (smallest, 3 * smallest + 1, 1000):
                parts = split_documents(split, count)
                assert all(part > 0 for wanted, part in zip(read, parts) if wanted)


def test_megatron_builds_only_the_parts_the_run_reads(sets, tmp_path):
    def spec(eval_cfg):
        cfg = SimpleNamespace(data=DataConfig(source="indexed", path=sets[200]), eval=eval_cfg,
                              model=ModelConfig(vocab=256), train=TrainConfig(), seed=1)
        return indexed_spec(SimpleNamespace(cfg=cfg, data_prefixes=(sets[200],),
                                            data_cache_dir=str(tmp_path)))

    data = DataConfig(source="indexed", path=sets[200])
    assert read_parts(EVAL, data) == (True, True, False)
    assert read_parts(QUIET, data)[1:] == (False, False)
    assert spec(EVAL).built == (True, True, False) and spec(EVAL).sizes[2] == 0
    assert spec(QUIET).built == (True, False, False) and spec(QUIET).sizes[1:] == (0, 0)


@pytest.mark.slow
def test_hybrid_train_launches_on_200_documents_with_the_default_split(sets, tmp_path):
    done = subprocess.run([TRAIN, "model=tiny", "parallel=single", "train.steps=2",
                           "train.global_batch=8", "train.timeline_step=0", "data=indexed",
                           f"data.path={sets[200]}", "eval.at_end=true", "eval.batches=2",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eval_loss" in done.stdout + done.stderr
    cache = tmp_path / "run" / "data_cache"
    assert list(cache.glob("*-train-*.npy")) and list(cache.glob("*-valid-*.npy"))
    assert not list(cache.glob("*-test-*"))
