"""Experience log: order, segments, queries, resume, torn tails truncated, corruption refused."""

from __future__ import annotations

import pytest

from exchange.log import MAGIC, ExperienceLogReader, ExperienceLogWriter, LogCorrupt, LogPosition
from exchange.samples import make_experiences


def _write(path, batches, **kw) -> None:
    with ExperienceLogWriter(path, **kw) as log:
        for batch in batches:
            log.append(batch)


def test_reads_back_in_order_by_model_and_by_prompt(tmp_path):
    exps = make_experiences(40, models=("m0", "m1"), group_size=4)
    _write(tmp_path, [exps[:15], exps[15:16], exps[16:]])
    reader = ExperienceLogReader(tmp_path)
    assert list(reader) == exps
    assert list(reader.by_model("m1")) == [e for e in exps if e.model == "m1"]
    assert list(reader.by_prompt(3)) == [e for e in exps if e.prompt_id == 3]
    assert list(reader.by_prompt(3, model="m0")) == [e for e in exps if e.prompt_id == 3 and e.model == "m0"]
    groups = reader.grouped_by_prompt()
    assert sorted(groups) == sorted({e.prompt_id for e in exps}) and sum(map(len, groups.values())) == 40


def test_segments_roll_over_and_reopening_appends(tmp_path):
    exps = make_experiences(30)
    _write(tmp_path, [[e] for e in exps[:20]], segment_bytes=8000)  # 3 experiences (3.6 KB each) per segment
    _write(tmp_path, [exps[20:]], segment_bytes=8000)
    assert len(list(tmp_path.glob("*.seg"))) >= 6
    assert list(ExperienceLogReader(tmp_path)) == exps


def test_replay_resumes_from_a_kept_position(tmp_path):
    exps = make_experiences(12)
    _write(tmp_path, [exps[:4], exps[4:8], exps[8:]], segment_bytes=20000)
    records = list(ExperienceLogReader(tmp_path).records())
    resume_at = next(pos for pos, exp in records if exp == exps[4])
    assert [e for _, e in ExperienceLogReader(tmp_path).records(start=resume_at)] == exps[4:]
    assert list(ExperienceLogReader(tmp_path).records(start=LogPosition(99, 0))) == []


def _segment(tmp_path):
    (seg,) = tmp_path.glob("*.seg")
    return seg


@pytest.mark.parametrize("cut_from_end", [1, 7, 8, 9, 100, 3000])
def test_torn_tail_is_truncated_on_open_and_never_misread(tmp_path, cut_from_end):
    exps = make_experiences(6)
    _write(tmp_path, [exps[:3], exps[3:]])
    seg = _segment(tmp_path)
    data = seg.read_bytes()
    seg.write_bytes(data[:-cut_from_end])  # a crash in the middle of the second frame
    assert list(ExperienceLogReader(tmp_path)) == exps[:3]  # readers stop at the tear
    writer = ExperienceLogWriter(tmp_path)
    assert writer.truncated_bytes == len(data) - cut_from_end - seg.stat().st_size
    writer.append(exps[3:])
    writer.close()
    assert list(ExperienceLogReader(tmp_path)) == exps


def test_tail_with_bad_checksum_is_a_tear(tmp_path):
    exps = make_experiences(4)
    _write(tmp_path, [exps[:2], exps[2:]])
    seg = _segment(tmp_path)
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF  # last frame's payload never fully reached the disk
    seg.write_bytes(bytes(data))
    assert ExperienceLogWriter(tmp_path).truncated_bytes > 0
    assert list(ExperienceLogReader(tmp_path)) == exps[:2]


def test_torn_segment_header_is_repaired(tmp_path):
    tmp_path.joinpath("00000000.seg").write_bytes(MAGIC[:3])
    _write(tmp_path, [make_experiences(2)])
    assert list(ExperienceLogReader(tmp_path)) == make_experiences(2)


def test_damage_before_good_data_is_corruption_not_a_tear(tmp_path):
    exps = make_experiences(6)
    _write(tmp_path, [exps[:2], exps[2:4], exps[4:]])
    seg = _segment(tmp_path)
    data = bytearray(seg.read_bytes())
    data[len(MAGIC) + 20] ^= 0xFF  # inside the first frame
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=r"00000000\.seg.*byte 8"):
        list(ExperienceLogReader(tmp_path))
    with pytest.raises(LogCorrupt):
        ExperienceLogWriter(tmp_path)
    assert seg.stat().st_size == len(data)  # nothing was cut


def test_not_a_log_and_missing_directory_say_so(tmp_path):
    tmp_path.joinpath("00000000.seg").write_bytes(b"hello world, not a log")
    with pytest.raises(LogCorrupt, match="bad header"):
        list(ExperienceLogReader(tmp_path))
    with pytest.raises(FileNotFoundError, match="no experience log"):
        ExperienceLogReader(tmp_path / "missing")
