"""Recipes: rule matching, the ignore list, misfit policies, and JSON/TOML round trips."""

from __future__ import annotations

import pytest

from fewbits.formats.format import largest_dividing_group
from fewbits.models.recipe import LayerPlan, Recipe, RecipeError, Rule

# SmolLM2-135M's linear shapes (out, in) for one block, plus the (tied, ignored) head
SMOL = [
    ("model.layers.0.self_attn.q_proj", (576, 576)),
    ("model.layers.0.self_attn.k_proj", (192, 576)),
    ("model.layers.0.mlp.up_proj", (1536, 576)),
    ("model.layers.0.mlp.down_proj", (576, 1536)),
    ("lm_head", (49152, 576)),
]


def test_common_case_one_format_everything_but_the_head():
    plans = Recipe.from_format("int4-g64").plan(SMOL)
    assert [p.action for p in plans] == ["quantize"] * 4 + ["ignore"]
    assert {p.format for p in plans[:4]} == {"int4-g64"} and plans[0].method == "rtn"
    assert plans[-1].note == "ignore list"


def test_lm_head_in_its_own_format_by_rtn():
    r = Recipe.from_format("int4-g64", "gptq", lm_head="int8")
    plans = r.plan(SMOL)
    assert [(p.action, p.format, p.method) for p in plans[-2:]] == [("quantize", "int4-g64", "gptq"),
                                                                     ("quantize", "int8", "rtn")]
    assert not any("lm_head" in p for p in r.ignore) and any("embed" in p for p in r.ignore)  # embeddings stay
    assert Recipe.from_dict(r.to_dict()) == r  # the head's rule is an ordinary rule: it round-trips
    assert Recipe.from_format("int4-g64", lm_head="bf16").plan(SMOL)[-1].action == "ignore"  # a 16-bit head


def test_misfit_error_names_every_layer_and_shape():
    with pytest.raises(RecipeError) as e:
        Recipe.from_format("int4-g128").plan(SMOL)
    msg = str(e.value)
    assert "3 layer(s)" in msg and "--misfit" in msg
    for name in ("q_proj", "k_proj", "up_proj"):
        assert f"model.layers.0.self_attn.{name}" in msg or f"model.layers.0.mlp.{name}" in msg
    assert "down_proj" not in msg  # 1536 = 12 x 128 fits
    assert "576" in msg and "int4-g128" in msg


def test_misfit_keep_and_regroup():
    keep = Recipe.from_format("int4-g128", misfit="keep").plan(SMOL)
    assert [p.action for p in keep] == ["keep", "keep", "keep", "quantize", "ignore"]
    assert "576" in keep[0].note and "kept 16-bit" in keep[0].note
    reg = Recipe.from_format("int4-g128", misfit="regroup").plan(SMOL)
    assert [p.format for p in reg[:4]] == ["int4-g96", "int4-g96", "int4-g96", "int4-g128"]
    assert "group 96" in reg[0].note
    # MX blocks are part of the format: regroup cannot change them, so the layer stays 16-bit
    odd = [("a", (8, 48))]
    assert Recipe.from_format("mxfp4", misfit="regroup").plan(odd)[0].action == "keep"


@pytest.mark.parametrize("cols, asked, want", [(576, 128, 96), (576, 64, 64), (1536, 128, 128), (100, 64, 50),
                                               (7, 4, 1), (48, 32, 24)])
def test_largest_dividing_group(cols, asked, want):
    assert largest_dividing_group(cols, asked) == want


def test_rules_first_match_wins_and_unmatched_layers_stay():
    r = Recipe(rules=(Rule(r"down_proj$", "int8"), Rule(r"mlp\.", "int4-g64", "rtn"),
                      Rule(r"self_attn\.k_proj", "bf16")))
    plans = {p.name.split(".")[-1]: p for p in r.plan(SMOL)}
    assert plans["down_proj"].format == "int8"
    assert plans["up_proj"].format == "int4-g64"
    assert plans["k_proj"].action == "ignore" and "bf16" in plans["k_proj"].note
    assert plans["q_proj"].action == "ignore" and plans["q_proj"].note == "no rule matches"


def test_round_trips_json_toml_files(tmp_path):
    opts = {"damp": 0.02, "act_order": False, "block_size": 64}
    r = Recipe(rules=(Rule(r"mlp\.down_proj", "INT8", "rtn"), Rule(r".*", "int4-g64-asym", "gptq", opts)),
               ignore=(r"lm_head$", r'say "hi"\\'), misfit="regroup")
    assert r.rules[0].format == "int8"  # canonical spelling
    assert Recipe.from_json(r.to_json()) == r
    assert Recipe.from_toml(r.to_toml()) == r
    assert Recipe.from_dict(r.to_dict()) == r
    for name in ("r.toml", "r.json"):
        r.save(tmp_path / name)
        assert Recipe.load(tmp_path / name) == r
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.toml"]  # no temp files left


@pytest.mark.parametrize("bad, match", [
    ({"rules": []}, "at least one rule"),
    ({"rules": [{"pattern": "(", "format": "int8"}]}, "not a regular expression"),
    ({"rules": [{"pattern": ".*", "format": "int9"}]}, "int9"),
    ({"rules": [{"format": "int8"}]}, "needs 'pattern' and 'format'"),
    ({"rules": [{"pattern": ".*", "format": "int8"}], "misfit": "drop"}, "misfit policy 'drop'"),
    ({"rules": [{"pattern": ".*", "format": "int8"}], "version": 9}, "version 9"),
    ({"rules": [{"pattern": ".*", "format": "int8"}], "extra": 1}, "unknown keys"),
])
def test_bad_recipes_are_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        Recipe.from_dict(bad)


def test_bad_files(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        Recipe.load(tmp_path / "none.toml")
    (tmp_path / "x.toml").write_text("rules = [")
    with pytest.raises(RecipeError, match="not valid TOML"):
        Recipe.load(tmp_path / "x.toml")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(RecipeError, match="not valid JSON"):
        Recipe.load(tmp_path / "x.json")


def test_layer_plan_fmt():
    assert LayerPlan("a", (4, 4), "quantize", "int4-g64").fmt.group_size == 64
    assert LayerPlan("a", (4, 4), "ignore").fmt is None


def test_rule_options_are_typed_and_a_typo_is_an_error_naming_it():
    """A misspelled option used to be ignored silently (a rule with "block" ran with the default block size)."""
    from fewbits.methods.config import GPTQ

    rule = Rule(".*", "int4-g64", "gptq", {"damp": 0.02, "act_order": False})
    assert rule.config == GPTQ(damp=0.02, act_order=False)
    assert rule.options == {"damp": 0.02, "act_order": False}  # only what differs from the defaults
    with pytest.raises(RecipeError, match=r"no option 'block'; its options are act_order, block_size, damp, "
                                          r"expert_min_tokens, static_groups"):
        Rule(".*", "int4-g64", "gptq", {"block": 128})
    with pytest.raises(RecipeError, match=r"rtn has no option 'damp'; it takes no options"):
        Rule(".*", "int4-g64", "rtn", {"damp": 0.1})
    with pytest.raises(RecipeError, match=r"option damp must be a number, got 'high'"):
        Rule(".*", "int4-g64", "gptq", {"damp": "high"})
    with pytest.raises(RecipeError, match=r"option act_order must be true or false, got 1"):
        Rule(".*", "int4-g64", "gptq", {"act_order": 1})
    with pytest.raises(RecipeError, match=r"option block_size must be an integer, got 64.0"):
        Rule(".*", "int4-g64", "gptq", {"block_size": 64.0})
    # a typed config in place of the method's name: the same rule
    assert Rule(".*", "int4-g64", GPTQ(damp=0.02, act_order=False)) == rule


@pytest.mark.parametrize("toml, match", [
    ('method = "gptq"\noptions = {act_ordr = true}', r"recipe rule 0: .*no option 'act_ordr'.*act_order"),
    ('method = "hqq"\noptions = {iters = "many"}', r"recipe rule 0: .*option iters must be an integer"),
    ('method = "smoothquant"\noptions = {alpha = 1.5}', r"recipe rule 0: .*alpha must lie in \[0, 1\], got 1.5"),
    ('method = "llm-int8"\noptions = {threshold = -1}', r"threshold must be above 0"),
])
def test_recipe_file_options_are_checked(tmp_path, toml, match):
    p = tmp_path / "r.toml"
    p.write_text(f'[[rules]]\npattern = ".*"\nformat = "int8"\n{toml}\n')
    with pytest.raises(RecipeError, match=match):
        Recipe.load(p)


def test_plans_carry_the_typed_config():
    from fewbits.methods.config import GPTQ, RTN

    r = Recipe((Rule(r"mlp\.", "int4-g64", "gptq", {"damp": 0.05}), Rule(".*", "int8")))
    plans = {p.name.split(".")[-1]: p for p in r.plan(SMOL)}
    assert plans["up_proj"].config == GPTQ(damp=0.05) and plans["up_proj"].options == {"damp": 0.05}
    assert plans["q_proj"].config == RTN() and plans["lm_head"].config is None
