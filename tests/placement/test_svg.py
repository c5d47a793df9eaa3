"""`Plan.to_svg()`: a plain SVG that parses as XML and names every component and every device."""

import xml.etree.ElementTree as ET

import placement
from placement.devices import device_label
from placement.sizes import GiB, format_bytes

from synthetic import component, whole

SVG = "{http://www.w3.org/2000/svg}"


def texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return [element.text or "" for element in root.iter(f"{SVG}text")]


def test_every_component_and_device_appears_with_its_numbers():
    plan = placement.plan(
        {"text_encoder": whole(2), "denoiser": component([0.5] * 16, head=0.5), "vae": whole(1)},
        max_memory={0: "4GiB", 1: "3GiB", "cpu": "64GiB"}, activations={"denoiser": GiB // 2, "vae": GiB // 4},
    )
    svg = plan.to_svg()
    labels = texts(svg)
    joined = "\n".join(labels)
    for name in plan.components:
        assert name in labels  # its box in the component row
    for device in plan.devices:
        assert device_label(device.device) in labels
        assert f"budget {format_bytes(device.budget)}" in labels
        legend = next(text for text in labels if text.endswith(f"predicted peak {format_bytes(device.predicted_peak)}"))
        assert f"runtime overhead {format_bytes(device.overhead)}" in legend or not device.overhead
    gpu0 = plan.device(plan.components["denoiser"].execution_device)
    assert f"streaming working set {format_bytes(gpu0.streaming_working_set)}" in joined
    assert plan.verdict.headline in labels or "; ".join(labels[:2]) == plan.verdict.headline
    titles = [t.text for t in ET.fromstring(svg).iter(f"{SVG}title")]
    assert all(f"{a} -> {b}" in titles for a, b in plan.crossing_edges) and plan.crossing_edges


def test_a_plan_without_a_call_says_in_the_picture_that_activations_were_not_counted():
    parts = {"text_encoder": whole(2), "denoiser": component([0.5] * 16, head=0.5)}
    budgets = {0: "4GiB", "cpu": "64GiB"}
    without = " ".join(texts(placement.plan(parts, max_memory=budgets).to_svg()))
    assert "Activations NOT counted (planned without a call): each bar is weights + streaming working set only" in \
        without and "--height and --width with placement plan" in without
    with_call = placement.plan(parts, max_memory=budgets, activations={"denoiser": GiB // 4})
    assert with_call.activations_accounted and "NOT counted" not in " ".join(texts(with_call.to_svg()))


def test_names_that_need_escaping_stay_valid_xml():
    plan = placement.plan({"a<&>b": whole(1)}, max_memory={0: "4GiB", "cpu": "64GiB"})
    assert "a<&>b" in texts(plan.to_svg())


def test_a_plan_without_accelerators_draws_the_cpu():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = placement.plan({"a": whole(1)}, max_memory={"cpu": "8GiB"})
    labels = texts(plan.to_svg())
    assert "CPU" in labels and "a" in labels and "budget 8.00 GiB" in labels


def test_a_simulated_plan_and_an_empty_gpu_say_so_in_the_picture_and_in_explain(monkeypatch):
    """The demo's plan: small components on two 24 GiB GPUs this machine lacks; balanced keeps them together."""
    import placement.planner

    monkeypatch.setattr(placement.planner, "accelerators_present", lambda: 0)
    components = {"text_encoder": whole(0.01), "denoiser": whole(0.03), "vae": whole(0.02)}
    plan = placement.plan(components, max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"},
                          activations={"denoiser": GiB // 256}, graph=[("text_encoder", "denoiser"), ("denoiser", "vae")])
    assert {c.execution_device for c in plan.components.values()} == {0} and plan.simulated_accelerators == [0, 1]
    why = plan.left_empty[1]
    assert why.startswith("GPU 1 is left empty: this map keeps every component on GPU 0")
    assert "model-graph edges crossing devices (here 0)" in why and "2 runtime overheads instead of 1" in why
    explained = plan.explain()
    assert "Simulated: planned for GPU 0 and GPU 1, which the machine that planned it does not have (it has none)" \
        in explained and why in explained
    words = " ".join(texts(plan.to_svg()))
    assert "Simulated: planned for GPU 0 and GPU 1" in words and why in words  # wrapped over lines, all there
    again = placement.Plan.from_json(plan.to_json())
    assert again.left_empty == plan.left_empty and again.simulated_accelerators == [0, 1]

    monkeypatch.setattr(placement.planner, "accelerators_present", lambda: 2)  # a machine that has both
    present = placement.plan(components, max_memory={0: "24GiB", 1: "24GiB", "cpu": "64GiB"})
    assert not present.simulated_accelerators and "Simulated" not in present.explain() + present.to_svg()
