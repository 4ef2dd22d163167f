"""Adacc's settings are one options dataclass: the keyword call style still works, every default lives in
one place, and a wrong argument is refused at the boundary, naming it."""

import pytest
import torch

from leanml.config import ConfigError
from leanml.errors import LeanmlError
from leanml.memory import Adacc, AdaccOptions
from leanml.memory.budget import DEFAULT_BUDGET, Budget
from leanml.memory.hf import AdaccCallback

from .test_runtime import IDS, tiny_llama

torch.set_num_threads(1)


def test_defaults_live_in_the_options() -> None:
    model = tiny_llama()
    adacc = Adacc(model)
    assert adacc.options == AdaccOptions() and adacc.budget == DEFAULT_BUDGET
    assert AdaccCallback().budget == DEFAULT_BUDGET
    adacc.remove()


def test_keywords_and_options_object_give_the_same_settings_and_plan() -> None:
    """The keyword style of the tests and the runner, an options object, and an object with changes by name
    are one and the same configuration; planned from one profile, they give the same plan."""
    model = tiny_llama()
    by_name = Adacc(model, budget=0.6, compressors=["bf16", "int8-token"], max_error=0.1, compress_layers=[1])
    plan = by_name.prepare(input_ids=IDS, labels=IDS)
    by_name.remove()
    opts = AdaccOptions(budget=Budget("fraction", 0.6), compressors=("bf16", "int8-token"), max_error=0.1,
                        compress_layers=[1])
    assert by_name.options == opts
    changed = Adacc(model, AdaccOptions(budget=0.9, max_error=0.1, compress_layers=[1]),
                    compressors=("bf16", "int8-token"), budget="0.6", profile=by_name.profile)
    assert changed.options == opts
    again = changed.prepare(input_ids=IDS, labels=IDS)
    assert changed.history[0]["profile_reused"]
    assert again.to_json()["options"] == plan.to_json()["options"] and again.measured_peak == plan.measured_peak
    changed.remove()


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_error": "0.1"}, "max_error"),
    ({"check_every": 2.5}, "check_every"),
    ({"calibrate": 1}, "calibrate"),
    ({"compressors": "bf16"}, "compressors"),
    ({"thresholds": {"window": 3}}, "thresholds"),
])
def test_wrong_kinds_are_refused_naming_the_argument(kwargs: dict, name: str) -> None:
    # a TypeError from the options' own checks (or the config system's ConfigError when it checks kinds first)
    with pytest.raises((TypeError, ConfigError), match=rf"\b{name}\b"):
        AdaccOptions(**kwargs)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_error": 0.0}, "max_error"),
    ({"max_error": 1.5}, "max_error"),
    ({"outlier_frac": 1.0}, "outlier_frac"),
    ({"max_calibrations": 0}, "max_calibrations"),
    ({"check_every": -1}, "check_every"),
    ({"on_new_shape": "ignore"}, "on_new_shape"),
    ({"compile_blocks": (1.5,)}, "compile_blocks"),
])
def test_values_out_of_range_are_refused_naming_the_field(kwargs: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=rf"\b{name}\b") as err:
        AdaccOptions(**kwargs)
    assert name in err.value.fields


def test_unknown_arguments_and_a_positional_budget_are_type_errors() -> None:
    model = tiny_llama()
    with pytest.raises(TypeError, match="unknown argument.*max_eror"):
        Adacc(model, max_eror=0.1)
    with pytest.raises(TypeError, match="options must be an AdaccOptions.*budget=0.5"):
        Adacc(model, 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        Adacc("model")  # type: ignore[arg-type]
    with pytest.raises(LeanmlError, match="memory budget"):
        Adacc(model, budget="lots")
