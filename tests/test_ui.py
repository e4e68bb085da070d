"""The UI path in a real browser: headless Chromium (Debian's chromium + chromedriver, driven by selenium; `make
test` installs them, nothing is downloaded at run time) opens the local Prefect UI, finds deployment distill/tiny
(served by tests/server_fixtures.py), submits its run form with optim.lr changed, and the run completes with the
stages before training reused from the cache; then MLflow's compare view shows that run beside the default one.

Screenshots of the run page and of the compare view go to $DISTILLERY_SCREENSHOTS (the README's docs/*.png come
from `DISTILLERY_SCREENSHOTS=docs pytest tests/test_ui.py`), else to the test's tmp dir.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver  # make test installs it (Makefile: selenium + Debian chromium)
from selenium.webdriver.chrome.service import Service

from flows.compare import compare_view_url
from tests.server_fixtures import (
    FinishedRun,
    Served,
    stage_states,
    wait_run,
)

LR = 0.004
WAIT_S = 60
# The run form labels optional fields "<Title> (Optional)"; a field's input sits in the same property block.
FIELD_INPUT = (
    "//span[normalize-space()='{label}']/ancestor::div[contains(concat(' ', @class, ' '), ' schema-form-property ')]"
    "[1]//input"
)


@pytest.fixture(scope="module", name="browser")
def _browser() -> Iterator[Any]:
    """Headless Chromium through chromedriver, both from Debian (make test installs them)."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.fail("chromium and chromedriver are not installed: `make test` installs them (Debian packages)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(name="shots")
def _shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("DISTILLERY_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _screenshot(browser: Any, path: Path) -> Path:
    """A PNG of the page, reduced to a 256-colour palette (small enough for the repository)."""
    from PIL import Image

    browser.save_screenshot(str(path))
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)
    return path


def _ui_run_id(served: Served, since: float) -> str:
    """The flow run the form created: the deployment's newest run with optim.lr=LR, created after `since`."""
    deadline = time.monotonic() + WAIT_S
    with served.servers.api() as api:
        while time.monotonic() < deadline:
            reply = api.post(
                "/flow_runs/filter",
                json={"deployments": {"id": {"any_": [served.deployment_id]}}, "sort": "EXPECTED_START_TIME_DESC"},
            )
            reply.raise_for_status()
            for run in reply.json():
                created = time.mktime(time.strptime(run["created"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
                if run["parameters"]["cfg"]["optim"]["lr"] == LR and created >= since - 5:
                    return str(run["id"])
            time.sleep(1)
    pytest.fail(f"the run form created no flow run with optim.lr={LR} in {WAIT_S} s")


def _mlflow_run(client: Any, flow_run_id: str) -> Any:
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'",
    )
    assert runs, f"no MLflow run of flow run {flow_run_id}"
    return runs[0]


def test_run_form_in_chromium_completes_and_mlflow_compares(
    served: Served, default_run: FinishedRun, browser: Any, shots: Path
) -> None:
    from mlflow import MlflowClient
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, WAIT_S)
    ui = served.servers.ui_url

    def click(xpath: str) -> None:
        element = wait.until(ec.element_to_be_clickable((By.XPATH, xpath)))
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
        element.click()

    # Find the deployment from the deployments page, open its run form (Run -> Custom run).
    browser.get(f"{ui}/deployments")
    click(f"//a[normalize-space()='{served.deployment['name']}']")
    wait.until(ec.url_contains(f"/deployments/deployment/{served.deployment_id}"))
    click("//button[normalize-space()='Run']")
    click("//*[normalize-space()='Custom run']")
    wait.until(ec.url_contains("/run"))

    # Change one field (optim.lr) and submit.
    lr = wait.until(ec.presence_of_element_located((By.XPATH, FIELD_INPUT.format(label="Lr (Optional)"))))
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", lr)
    assert float(lr.get_attribute("value")) == served.deployment["parameters"]["cfg"]["optim"]["lr"]
    lr.clear()
    lr.send_keys(str(LR))
    submitted = time.time()
    click("//button[@type='submit' and normalize-space()='Submit']")

    run_id = _ui_run_id(served, submitted)
    run = wait_run(served.servers, run_id)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    cfg = run["parameters"]["cfg"]
    defaults = served.deployment["parameters"]["cfg"]
    assert {k: v for k, v in cfg.items() if k != "optim"} == {k: v for k, v in defaults.items() if k != "optim"}
    stages = stage_states(served.servers, run_id, expect=("tokenize", "teacher-plan", "train-epoch-0", "export"))
    assert stages["tokenize"] == "Cached" and stages["teacher-plan"] == "Cached", stages
    assert stages["train-epoch-0"] == "Completed" and stages["export"] == "Completed", stages

    # The run page shows it completed.
    browser.get(f"{ui}/runs/flow-run/{run_id}")
    wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "Completed"))
    wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), run["name"]))
    time.sleep(2)  # let the timeline finish drawing
    assert _screenshot(browser, shots / "prefect-run.png").stat().st_size > 10_000

    # MLflow's compare view of the default run and the form's run.
    client = MlflowClient(tracking_uri=served.servers.mlflow_url)
    runs = [_mlflow_run(client, default_run.id), _mlflow_run(client, run_id)]
    assert {r.data.params["optim.lr"] for r in runs} == {str(defaults["optim"]["lr"]), str(LR)}
    url = compare_view_url(served.servers.mlflow_url, runs[0].info.experiment_id, [r.info.run_id for r in runs])
    assert url is not None
    browser.get(url)
    for r in runs:
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), r.info.run_name))
    for toggle in ("Parameters - Show diff only", "Metrics - Show diff only"):
        click(f"//button[@aria-label='{toggle}']")
    for key in ("optim.lr", "best/kl", "epoch/tokens_per_s"):
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), key))
    for close in browser.find_elements(By.XPATH, "//button[@aria-label='Close']"):  # the assistant panel
        close.click()
    browser.execute_script(
        "arguments[0].scrollIntoView({block: 'start'});",
        browser.find_element(By.XPATH, "//*[normalize-space()='Run details']"),
    )
    time.sleep(1)
    assert _screenshot(browser, shots / "mlflow-compare.png").stat().st_size > 10_000
