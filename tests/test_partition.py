import pytest

from ringsched.layout.partition import (
    ENV_OVERRIDE,
    PartitionError,
    default_partition,
    get_pp_indices,
    head_layers,
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


def test_an_uneven_override_warns_and_the_default_says_its_balance(caplog, monkeypatch):
    import logging

    from ringsched.layout.partition import log_partition, partition_source

    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    with caplog.at_level(logging.INFO, logger="ringsched.layout.partition"):
        log_partition([30], partition_source(None))
        assert caplog.records == []  # one stage: nothing to say
        log_partition([15, 15], partition_source("15,15"))
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", "layer partition [15, 15] (--pp-layer-partition 15,15)")
        ]
        caplog.clear()
        log_partition([16, 14], partition_source("16,14"))
        (record,) = caplog.records
        assert record.levelname == "WARNING" and "uneven layer partition [16, 14] (--pp-layer-partition 16,14)" in (
            record.message
        )
        caplog.clear()
        # With the head counted the even split is the uneven one: 15 + 3 against 15.
        log_partition([15, 15], partition_source("15,15"), head=3.0)
        (record,) = caplog.records
        assert record.levelname == "WARNING" and "head counted as 3.0 layers" in record.message
        assert "costs 8.3% of throughput" in record.message  # 1 - 16.5 / 18
        caplog.clear()
        log_partition([16, 14], partition_source(None), head=2.0)
        (record,) = caplog.records
        assert record.levelname == "INFO" and "[16, 14] (the default split; the last stage's head counted as 2.0" in (
            record.message
        )
        assert "costs 0.0% of throughput" in record.message
        monkeypatch.setenv(ENV_OVERRIDE, "17,13")
        assert partition_source(None) == f"{ENV_OVERRIDE}=17,13"


def _old_even_split(layers: int, size: int) -> list[int]:
    """The split without a head weight, as first specified: even, the remainder to stages size-2, size-3, ..."""
    base, rem = divmod(layers, size)
    counts = [base] * size
    for i in range(rem):
        counts[size - 2 - i] += 1
    return counts


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 7])
def test_without_a_head_weight_the_default_is_the_even_split(size):
    for layers in range(size, 90):
        assert default_partition(layers, size) == _old_even_split(layers, size), layers


def _brute_force_slowest(layers: int, size: int, head: float) -> float:
    import itertools

    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), size - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True)]
        best = min(best, max(*counts[:-1], counts[-1] + head))
    return best


@pytest.mark.parametrize("layers,size", [(30, 2), (12, 3), (9, 4), (13, 3), (5, 5)])
@pytest.mark.parametrize("head", [0.0, 0.4, 1.0, 2.67, 7.5, 40.0])
def test_the_default_makes_the_slowest_stage_as_fast_as_any_split_can(layers, size, head):
    counts = default_partition(layers, size, head)
    assert sum(counts) == layers and min(counts) >= 1 and len(counts) == size
    slowest = max(*counts[:-1], counts[-1] + head) if size > 1 else counts[0] + head
    expect = _brute_force_slowest(layers, size, head) if size > 1 else layers + head
    assert slowest == pytest.approx(expect)
    assert max(counts[:-1], default=0) - min(counts[:-1], default=0) <= 1  # the stages before the last: even


def test_head_weights_from_the_models_shape():
    from ringsched.capacity.presets import MODEL_PRESETS

    smollm2 = MODEL_PRESETS["smollm2-135m-instruct"]  # the planner's shape; the engine's ModelConfig below
    assert head_layers(smollm2) == pytest.approx(4.0)
    assert default_partition(30, 2, head_layers(smollm2)) == [17, 13]
    assert resolve_partition(30, 2, None, head_layers(smollm2)) == [17, 13]
    assert resolve_partition(30, 2, "15,15", head_layers(smollm2)) == [15, 15]  # an override is taken as given
    llama8b = MODEL_PRESETS["llama-3-8b"]
    assert head_layers(llama8b) == pytest.approx(1.2, abs=0.01)
    assert default_partition(32, 2, head_layers(llama8b)) == [17, 15]
    llama70b = MODEL_PRESETS["llama-3-70b"]
    assert head_layers(llama70b) == pytest.approx(0.61, abs=0.01)
    assert default_partition(80, 2, head_layers(llama70b)) == [40, 40]  # a big model's head weighs under a layer
    assert default_partition(80, 6, head_layers(llama70b)) == [13, 13, 13, 14, 14, 13]
    with pytest.raises(PartitionError, match="head weight"):
        default_partition(30, 2, -1.0)


def test_the_engine_splits_smollm2_with_its_head_counted(smollm2_dir, monkeypatch):
    from ringsched.config import EngineConfig
    from ringsched.spec import ModelSpec

    monkeypatch.delenv(ENV_OVERRIDE, raising=False)
    assert ModelSpec.resolve(EngineConfig(model=str(smollm2_dir), pp_size=2)).partition == (17, 13)
    assert ModelSpec.resolve(EngineConfig(model=str(smollm2_dir), pp_size=3)).partition == (11, 11, 8)
    given = EngineConfig(model=str(smollm2_dir), pp_size=2, pp_layer_partition="15,15")
    assert ModelSpec.resolve(given).partition == (15, 15)
