import pytest

from ringsched.parallel.partition import (
    ENV_OVERRIDE,
    PartitionError,
    default_partition,
    get_pp_indices,
    resolve_partition,
    stage_ranges,
    uneven_loss,
)


def test_even_and_design_doc_examples():
    assert resolve_partition(80, 2) == [40, 40]
    assert resolve_partition(80, 6) == [13, 13, 13, 14, 14, 13]
    assert abs(uneven_loss([13, 13, 13, 14, 14, 13]) - 0.048) < 0.001
    assert resolve_partition(30, 1) == [30]


@pytest.mark.parametrize("layers,size", [(30, 4), (31, 4), (7, 3), (80, 7), (5, 5), (13, 4)])
def test_remainder_goes_before_last_and_middle_first(layers, size):
    counts = default_partition(layers, size)
    assert sum(counts) == layers and min(counts) >= 1
    base, rem = divmod(layers, size)
    assert counts[-1] == base  # the last stage (norm + lm_head) never takes an extra layer
    if 0 < rem <= size - 2:
        assert counts[0] == base  # the first stage (embedding) is spared too
    ranges = stage_ranges(counts)
    assert [get_pp_indices(layers, r, size) for r in range(size)] == ranges


def test_override_list_and_string():
    assert resolve_partition(30, 2, "16,14") == [16, 14]
    assert resolve_partition(30, 2, [10, 20]) == [10, 20]


def test_override_from_env(monkeypatch):
    monkeypatch.setenv(ENV_OVERRIDE, "20,10")
    assert resolve_partition(30, 2) == [20, 10]
    assert resolve_partition(30, 2, "15,15") == [15, 15]  # the flag wins over the environment


@pytest.mark.parametrize(
    "override,needle",
    [
        ("16,x", "not an integer"),
        ("10,10,10", "has 3 entries but --pp-size is 2"),
        ("16,15", "sums to 31 but the model has 30"),
        ("30,0", "no layers"),
        ("31,-1", "no layers"),
    ],
)
def test_override_errors(override, needle):
    with pytest.raises(PartitionError, match=needle):
        resolve_partition(30, 2, override)


def test_env_error_names_env(monkeypatch):
    monkeypatch.setenv(ENV_OVERRIDE, "a,b")
    with pytest.raises(PartitionError, match=ENV_OVERRIDE):
        resolve_partition(30, 2)


def test_more_stages_than_layers_and_bad_size():
    with pytest.raises(PartitionError, match="more stages than"):
        resolve_partition(4, 5)
    with pytest.raises(PartitionError, match="--pp-size must be >= 1"):
        resolve_partition(4, 0)
    with pytest.raises(PartitionError, match="outside"):
        get_pp_indices(10, 2, 2)


def test_an_uneven_split_warns_and_an_even_default_says_nothing(caplog, monkeypatch):
    import logging

    from ringsched.parallel.partition import log_partition, partition_source

    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    with caplog.at_level(logging.INFO, logger="ringsched.parallel.partition"):
        log_partition([15, 15], partition_source(None))
        assert caplog.records == []
        log_partition([15, 15], partition_source("15,15"))
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "layer partition [15, 15] (--pp-layer-partition 15,15)")
        ]
        caplog.clear()
        log_partition([16, 14], partition_source(None))
        (record,) = caplog.records
        assert record.levelname == "WARNING" and "uneven layer partition [16, 14] (the default split)" in record.message
        monkeypatch.setenv(ENV_OVERRIDE, "17,13")
        assert partition_source(None) == f"{ENV_OVERRIDE}=17,13"
