"""The pages in headless Chromium: seed 000's and 001's figures on the defaults, every control against
`fewbits plan --json` / `fewbits try --json`, a dropped config.json, the API's messages, no console errors."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from fewbits.cli import main

pytestmark = pytest.mark.usefixtures("browser")
CONFIGS = Path(__file__).parents[1] / "models" / "data"
TABLE = ["--table-weights", "bf16,int8,int4", "--table-kv", "bf16,fp8-e4m3"]


def cli_json(*args: str) -> dict:
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def wait_for(drv, cond, what: str, timeout: float = 15):  # noqa: ANN001, ANN201
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(drv, timeout, poll_frequency=0.05).until(lambda d: cond(d))
    except TimeoutException:
        raise AssertionError(f"timed out waiting for {what}") from None


def text(drv, el_id: str) -> str:  # noqa: ANN001
    return drv.find_element("id", el_id).text


def console_errors(drv) -> list[str]:  # noqa: ANN001
    return [e["message"] for e in drv.get_log("browser") if e["level"] == "SEVERE"]


def open_page(drv, url: str) -> None:  # noqa: ANN001
    # Leave the earlier page first: a request it still had in flight can log after a plain get_log, and
    # then counts against the next page (a 422 of the bad-input test once failed the playground's check).
    drv.get("about:blank")
    drv.get_log("browser")  # drop what earlier pages logged
    drv.get(url)
    wait_for(drv, lambda d: d.find_element("tag name", "body").get_attribute("data-ready"), f"{url} to load")


def expected_view(d: dict) -> dict[str, str]:
    """What the explorer must show for one `fewbits plan --json` answer, formatted as seed 000 writes it."""
    mem = (f"Memory: {d['memory_weights'] / 1e9:.2f} GB of weights + {d['memory_kv'] / 1e9:.2f} GB of cache = "
           f"{(d['memory_weights'] + d['memory_kv']) / 1e9:.2f} GB of {d['memory_capacity'] / 1e9:.0f} GB")
    return {"out-weight-bytes": f"{d['weight_bytes'] / 1e9:.2f} GB", "out-kv-bytes": f"{d['kv_bytes'] / 1e9:.2f} GB",
            "out-time": f"{d['time_s'] * 1e3:.2f} ms", "out-tps": f"{d['tokens_per_s']:.0f}",
            "out-speedup": f"{d['speedup']:.2f}× BF16", "out-time-note": f"{d['bound']}-bound; was "
            f"{d['bf16_time_s'] * 1e3:.2f} ms", "out-memory": mem}


def shown(drv) -> dict[str, str]:  # noqa: ANN001
    return {k: text(drv, k) for k in ("out-weight-bytes", "out-kv-bytes", "out-time", "out-tps", "out-speedup",
                                      "out-time-note", "out-memory")}


def matches(drv, want: dict[str, str]) -> bool:  # noqa: ANN001
    got = shown(drv)
    return all(got[k] == v if k != "out-memory" else got[k].startswith(v) for k, v in want.items())


def wait_view(drv, want: dict[str, str], what: str) -> None:  # noqa: ANN001
    try:
        wait_for(drv, lambda d: matches(d, want), what)
    except AssertionError:
        raise AssertionError(f"{what}: page shows {shown(drv)}, plan --json gives {want}") from None


def test_explorer_defaults_show_seed_000(browser, server, artefacts) -> None:  # noqa: ANN001
    open_page(browser, server + "/")
    want = {"out-weight-bytes": "15.01 GB", "out-weight-was": "was 15.01 GB", "out-kv-bytes": "8.59 GB",
            "out-kv-was": "was 8.59 GB", "out-time": "9.31 ms", "out-time-note": "memory-bound; was 9.31 ms",
            "out-tps": "1719", "out-speedup": "1.00× BF16",
            "out-memory": "Memory: 16.06 GB of weights + 8.59 GB of cache = 24.65 GB of 80 GB. Fits."}
    wait_for(browser, lambda d: text(d, "out-time") == "9.31 ms", "the default step time")
    assert {k: text(browser, k) for k in want} == want
    bars = [li.get_attribute("textContent") for li in browser.find_elements("css selector", "#bar-list li")]
    assert bars == ["W bf16 · KV bf16: 9.3 ms", "W bf16 · KV fp8-e4m3: 7.7 ms", "W int8 · KV bf16: 6.5 ms",
                    "W int8 · KV fp8-e4m3: 4.9 ms", "W int4 · KV bf16: 5.1 ms", "W int4 · KV fp8-e4m3: 3.5 ms"]
    assert text(browser, "command") == ("fewbits plan --model llama-3-8b --device h100 --batch 16 --context 4096 "
                                        "--weights bf16 --kv bf16 --profile seed " + " ".join(TABLE))
    browser.save_screenshot(str(artefacts / "explorer.png"))
    browser.find_element("id", "copy").click()
    wait_for(browser, lambda d: text(d, "copied") == "copied", "the copy button")
    assert console_errors(browser) == []


def test_each_explorer_control_gives_plan_json(browser, server) -> None:  # noqa: ANN001
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    open_page(browser, server + "/")
    state = {"--model": "llama-3-8b", "--device": "h100", "--batch": "16", "--context": "4096", "--weights": "bf16",
             "--kv": "bf16", "--devices": "1", "--profile": "seed"}
    steps = [("model", "select", "qwen2.5-7b"), ("device", "select", "h200"), ("weights", "select", "int4-g128"),
             ("kv", "select", "fp8-e4m3"), ("batch", "input", "64"), ("context", "input", "8192"),
             ("devices", "input", "2"), ("profile", "select", "default")]
    for el_id, kind, value in steps:
        el = browser.find_element("id", el_id)
        if kind == "select":
            Select(el).select_by_value(value)
        else:
            el.send_keys(Keys.CONTROL, "a")
            el.send_keys(value, Keys.TAB)
        state[f"--{el_id}"] = value
        args = ["plan", *[x for kv in state.items() for x in kv], *TABLE]
        wait_view(browser, expected_view(cli_json(*args)), f"after {el_id}={value}")
        # the copied command is that state (--devices written only when it is not 1)
        shown_args = shlex.split(text(browser, "command"))[2:]
        got = dict(zip(shown_args[::2], shown_args[1::2], strict=True))
        assert got == {**{k: v for k, v in state.items() if (k, v) != ("--devices", "1")},
                       "--table-weights": "bf16,int8,int4", "--table-kv": "bf16,fp8-e4m3"}
    # the state is in the URL: opening it again shows the same numbers
    url = browser.current_url
    assert "batch=64" in url and "model=qwen2.5-7b" in url
    want = shown(browser)
    open_page(browser, url)
    wait_view(browser, want, "the shared URL")
    assert console_errors(browser) == []


def test_dropped_config_of_a_model_that_is_no_preset(browser, server, tmp_path) -> None:  # noqa: ANN001
    cfg = CONFIGS / "gemma3_4b_config.json"
    open_page(browser, server + "/")
    wait_for(browser, lambda d: text(d, "out-time") == "9.31 ms", "the defaults")
    browser.find_element("id", "config-file").send_keys(str(cfg))
    d = cli_json("plan", "--model", str(cfg), "--device", "h100", "--batch", "16", "--context", "4096",
                 "--profile", "seed", *TABLE)
    assert d["model"] == "gemma3_4b_config"
    wait_view(browser, expected_view(d), "the dropped gemma-3-4b config")
    assert "gemma3_4b_config.json" in text(browser, "command")
    assert console_errors(browser) == []


def test_bad_input_shows_the_api_message(browser, server) -> None:  # noqa: ANN001
    import httpx
    from selenium.webdriver.common.keys import Keys

    open_page(browser, server + "/")
    wait_for(browser, lambda d: text(d, "out-time") == "9.31 ms", "the defaults")
    el = browser.find_element("id", "batch")
    el.send_keys(Keys.CONTROL, "a")
    el.send_keys("100000", Keys.TAB)
    detail = httpx.post(server + "/api/plan", json={"batch": 100000}).json()["detail"]
    assert "65536" in detail
    wait_for(browser, lambda d: text(d, "error") == detail, "the batch error on the page")
    el = browser.find_element("id", "batch")
    el.send_keys(Keys.CONTROL, "a")
    el.send_keys("16", Keys.TAB)
    wait_for(browser, lambda d: text(d, "error") == "", "the error to clear")
    tw = browser.find_element("id", "table-weights")
    tw.send_keys(Keys.CONTROL, "a")
    tw.send_keys("bf16,int12", Keys.TAB)
    detail = httpx.post(server + "/api/plan", json={"table_weights": ["bf16", "int12"]}).json()["detail"]
    wait_for(browser, lambda d: text(d, "error") == detail and "int12" in detail, "the format error on the page")
    assert all("status of 422" in e for e in console_errors(browser))  # the refused requests, nothing else


def test_playground_defaults_show_seed_001(browser, server, artefacts) -> None:  # noqa: ANN001
    open_page(browser, server + "/playground")
    wait_for(browser, lambda d: d.find_element("tag name", "body").get_attribute("data-layer"), "the layer table")
    rows = browser.find_elements("css selector", "#layer-table tr.layer-row")
    errs = [r.find_elements("tag name", "td")[2].text for r in rows]
    assert errs == ["0.72%", "14.76%", "12.21%", "10.17%", "25.58%", "0.96%", "3.18%", "0.73%"]
    assert rows[0].find_elements("tag name", "td")[0].text == "int8: 512 weights per scale"
    t = cli_json("try")
    wait_for(browser, lambda d: text(d, "out-zeros") == str(t["zeros"]), "the try summary")
    assert text(browser, "out-rel") == f"{100 * t['rel_error']:.2f}%"
    assert text(browser, "out-bpw") == f"{t['bits_per_weight']:.3f}"
    browser.save_screenshot(str(artefacts / "playground.png"))
    assert console_errors(browser) == []


def test_each_playground_control_gives_try_json(browser, server) -> None:  # noqa: ANN001
    from selenium.webdriver.support.ui import Select

    open_page(browser, server + "/playground")
    wait_for(browser, lambda d: text(d, "out-spec") == "int4-narrow", "the defaults")

    def check(args: list[str], what: str) -> None:
        t = cli_json("try", *args)
        want = (t["spec"], str(t["zeros"]), f"{100 * t['rel_error']:.2f}%", f"{t['bits_per_weight']:.3f}")
        wait_for(browser, lambda d: tuple(text(d, k) for k in ("out-spec", "out-zeros", "out-rel", "out-bpw")) == want,
                 f"{what}: try --json {args} gives {want}")

    browser.execute_script("const b = document.getElementById('bits'); b.value = '8';"
                           "b.dispatchEvent(new Event('change'));")
    check(["--bits", "8"], "bits 8")
    browser.execute_script("const b = document.getElementById('bits'); b.value = '4';"
                           "b.dispatchEvent(new Event('change'));")
    browser.find_element("id", "outlier").click()
    check(["--outlier"], "outlier")
    Select(browser.find_element("id", "group")).select_by_value("8")
    check(["--outlier", "--group", "8"], "groups of 8")
    browser.find_element("id", "fullgrid").click()
    check(["--outlier", "--group", "8", "--full-grid"], "full grid")
    browser.find_element("id", "asym").click()
    check(["--outlier", "--group", "8", "--asym"], "asym")
    Select(browser.find_element("id", "family")).select_by_value("nf4")
    check(["--outlier", "--group", "8", "--family", "nf4"], "nf4 (asym switched off)")
    Select(browser.find_element("id", "family")).select_by_value("nvfp4")
    check(["--outlier", "--family", "nvfp4"], "nvfp4")
    # 64 pasted weights; 63 is the API's message on the page
    pasted = ", ".join(str((i - 32) / 1000) for i in range(64))
    browser.execute_script("const p = document.getElementById('pasted'); p.value = arguments[0];"
                           "p.dispatchEvent(new Event('change'));", pasted)
    wait_for(browser, lambda d: text(d, "out-spec") == "nvfp4" and text(d, "error") == "", "the pasted weights")
    browser.execute_script("const p = document.getElementById('pasted'); p.value = arguments[0];"
                           "p.dispatchEvent(new Event('change'));", pasted.rsplit(",", 1)[0])
    wait_for(browser, lambda d: "64" in text(d, "error") and "weights" in text(d, "error"), "the 63-weight error")
    assert all("status of 422" in e for e in console_errors(browser))  # the refused request, nothing else


def test_results_page(browser, server, artefacts) -> None:  # noqa: ANN001
    from selenium.webdriver.support.ui import Select

    open_page(browser, server + "/results")
    sel = Select(browser.find_element("id", "report"))
    labels = [o.text for o in sel.options]
    assert "demo/results.json (demo)" in labels and not any("notes.json" in x for x in labels)
    sel.select_by_visible_text("demo/results.json (demo)")
    wait_for(browser, lambda d: "int4-g64" in text(d, "table"), "the demo table")
    assert "KL" in text(browser, "chart1-caption")
    browser.save_screenshot(str(artefacts / "results.png"))
    bench = [x for x in labels if "(bench)" in x]
    if bench:
        sel.select_by_visible_text(bench[0])
        wait_for(browser, lambda d: "Predicted against measured" in text(d, "chart1-caption"), "the bench chart")
    assert console_errors(browser) == []


def test_controls_are_labelled_and_the_layout_fits_a_phone(browser, server, artefacts) -> None:  # noqa: ANN001
    for page in ("/", "/playground", "/results"):
        open_page(browser, server + page)
        unlabelled = browser.execute_script(
            "return [...document.querySelectorAll('input, select, textarea, button')].filter(e => !("
            "e.getAttribute('aria-label') || (e.id && document.querySelector(`label[for='${e.id}']`)) ||"
            " e.closest('label') || e.textContent.trim())).map(e => e.id || e.outerHTML)")
        assert unlabelled == [], f"{page}: controls without a label: {unlabelled}"
    browser.set_window_size(390, 844)
    try:
        open_page(browser, server + "/")
        wait_for(browser, lambda d: text(d, "out-time") == "9.31 ms", "the defaults on a phone")
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the page is {overflow} px wider than a phone screen"
        browser.save_screenshot(str(artefacts / "explorer-phone.png"))
    finally:
        browser.set_window_size(1280, 1400)
    # keyboard: Tab from the top reaches the model selector, then the drop zone, before anything else
    open_page(browser, server + "/")
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    order = []
    for _ in range(6):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        order.append(browser.execute_script("return document.activeElement.id || document.activeElement.tagName"))
    assert "model" in order and "drop" in order and order.index("model") < order.index("drop")
