// Draws a run's curves with uPlot from the REST API; each chart's figure gets data-points="N" once drawn.
(async function () {
  const section = document.getElementById("charts");
  if (!section) return;
  const run = section.dataset.run;
  const get = async (path) => (await fetch(path)).json();
  const [metrics, evals] = await Promise.all([get(`/v1/runs/${run}/metrics`), get(`/v1/runs/${run}/evals?limit=500`)]);
  const series = metrics.series;
  const colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];

  function draw(figure, xLabel, xs, lines) {
    const present = lines.filter((l) => l.values.some((v) => v !== null));
    figure.dataset.points = String(xs.length * present.length);
    if (!xs.length || !present.length) {
      figure.insertAdjacentHTML("beforeend", "<p class='empty'>no data yet</p>");
      return;
    }
    const opts = {
      width: 380, height: 200,
      scales: { x: { time: false } },
      axes: [{ label: xLabel }, { values: (u, ticks) => ticks.map((v) => +v.toPrecision(3)) }],
      series: [{ label: xLabel }, ...present.map((l, i) => ({ label: l.label, stroke: colours[i % colours.length], width: 2 }))],
    };
    new uPlot(opts, [xs, ...present.map((l) => l.values)], figure);
  }

  function byStep(names) {
    const steps = [...new Set(names.flatMap((n) => (series[n] || []).map((p) => p.step)))].sort((a, b) => a - b);
    const lines = names.map((n) => {
      const at = new Map((series[n] || []).map((p) => [p.step, p.value]));
      return { label: n, values: steps.map((s) => (at.has(s) ? at.get(s) : null)) };
    });
    return [steps, lines];
  }

  for (const figure of section.querySelectorAll("figure.chart")) {
    const id = figure.id.replace("chart-", "");
    if (id === "sft") {
      const losses = figure.dataset.losses.split(",").map(Number);
      const every = Number(figure.dataset.every);
      draw(figure, "step", losses.map((_, i) => 1 + i * every), [{ label: "loss", values: losses }]);
    } else if (id === "evals") {
      const done = evals.items.filter((e) => e.resolved_rate.value !== null).sort((a, b) => a.version - b.version);
      draw(figure, "version", done.map((e) => e.version), [
        { label: "pass@1", values: done.map((e) => e.pass_at_1.value) },
        { label: "pass@k", values: done.map((e) => e.pass_at_k.value) },
        { label: "resolved rate", values: done.map((e) => e.resolved_rate.value) },
      ]);
    } else if (id === "throughput") {
      const [steps, [tokens, seconds]] = byStep(["tokens", "step_seconds"]);
      draw(figure, "step", steps, [
        { label: "tokens/s", values: tokens.values.map((t, i) => (t !== null && seconds.values[i] ? t / seconds.values[i] : null)) },
      ]);
    } else {
      const [steps, lines] = byStep(figure.dataset.metrics.split(",").filter(Boolean));
      draw(figure, "step", steps, lines);
    }
  }
  section.dataset.drawn = "true";
})();
