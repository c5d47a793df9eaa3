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
