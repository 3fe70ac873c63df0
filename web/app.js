// The storm explorer: every change of a control asks /api/sim (keel::sim in C++) for two runs,
// policy A and policy B on the same fleet and seed, and redraws both on the same axes (A solid,
// B dashed) with their summaries side by side. Requests are debounced, and a late answer never
// overwrites a newer one. document.body.dataset carries what the browser test reads: A's peak
// and peak retries (peak, peakRetries), B's (peakB, peakRetriesB), and how long the last draw
// took (drawMs), and the breakers' figures (outageCalls, probes; outageCallsB, probesB). The
// "shared breakers (fleet)" box switches both runs to the fleet-outage scenario: A with a breaker
// per pod, B with the breakers shared by the fleet. The "limits" choice switches both runs to a
// limits comparison: the receiver under 3x overload (A: fixed admission 2x too high, B: adaptive
// admission), or 8 workers against a 50/s limit (A: a bucket per process, B: the fleet's shared
// bucket); their figures are in goodput, servedP99, throttled and limited (and ...B).
(function () {
  'use strict';
  const fields = ['fleet', 'capacity', 'outage_s', 'attempts', 'base_ms'];
  const toggles = ['jitter', 'budget', 'breaker', 'limit'];
  // The limits comparisons: scenario, then policy A and policy B.
  const comparisons = {
    overload: ['overload-3x', 'fixed-admission-2x', 'adaptive-admission'],
    'fleet-rate': ['fleet-rate-limit', 'full-jitter+rate-limit', 'full-jitter+shared-rate-limit'],
  };
  const $ = (id) => document.getElementById(id);
  let plot = null;
  let latest = 0;
  let timer = null;

  // The query of policy `which` ('a' or 'b'): the shared fields, and that policy's toggles.
  function query(which) {
    const params = new URLSearchParams();
    const compare = document.querySelector('input[name="limits"]:checked').value;
    if (comparisons[compare]) {
      const [scenario, a, b] = comparisons[compare];
      params.set('scenario', scenario);
      params.set('policy', which === 'a' ? a : b);
      return params;
    }
    if ($('shared').checked) {
      params.set('fleet_breakers', which === 'a' ? 'per-pod' : 'shared');
      params.set('outage_s', $('outage_s-value').value.trim());
      return params;
    }
    for (const f of fields) params.set(f, $(f + '-value').value.trim());
    for (const t of toggles) {
      params.set(t, $(which === 'a' ? t : 'b_' + t).checked ? '1' : '0');
    }
    return params;
  }

  function showError(message) {
    const box = $('error');
    box.textContent = message;
    box.hidden = false;
    document.body.dataset.state = 'error';
  }

  const stepped = () => uPlot.paths.stepped({ align: 1 });
  const dashed = [6, 4];

  function draw(a, b) {
    const width = Math.max(400, $('chart').clientWidth);
    const opts = {
      width: width,
      height: 420,
      title: 'calls per ' + a.slice_ms + ' ms slice (A solid, B dashed)',
      scales: { x: { time: false } },
      axes: [{ label: 'time (s)' }, { label: 'calls', size: 60 }],
      series: [
        { label: 't (s)' },
        { label: 'A all calls', stroke: '#4477aa', fill: 'rgba(68,119,170,0.18)', paths: stepped() },
        { label: 'A retries', stroke: '#cc3311', paths: stepped() },
        { label: 'A successes', stroke: '#228833', paths: stepped() },
        { label: 'B all calls', stroke: '#4477aa', dash: dashed, width: 2, paths: stepped() },
        { label: 'B retries', stroke: '#cc3311', dash: dashed, width: 2, paths: stepped() },
        { label: 'B successes', stroke: '#228833', dash: dashed, width: 2, paths: stepped() },
      ],
    };
    // Both runs have the same duration and slices, so they share the time column.
    const rows = [a.series.t_s, a.series.offered, a.series.retries, a.series.successes,
                  b.series.offered, b.series.retries, b.series.successes];
    if (plot) plot.destroy();
    plot = new uPlot(opts, rows, $('chart'));
  }

  function summarize(data, which) {
    $('policy-' + which).textContent = data.policy;
    $('peak-' + which).textContent = data.peak_per_slice;
    $('peak-retries-' + which).textContent = data.peak_retries_per_slice;
    $('total-' + which).textContent = data.total_calls;
    $('amplification-' + which).textContent = data.amplification.toFixed(2) + 'x';
    $('ops-' + which).textContent = data.ops_succeeded + ' / ' + data.ops_failed;
    $('outage-calls-' + which).textContent = data.outage_calls;
    $('probes-' + which).textContent = data.probes;
    $('ops-recovery-' + which).textContent =
        data.ops_recovery_s === null ? 'never' : data.ops_recovery_s + ' s';
    $('goodput-' + which).textContent = data.goodput_per_s.toFixed(1);
    $('served-p99-' + which).textContent =
        data.served_p99_ms === null ? '-' : data.served_p99_ms.toFixed(1) + ' ms';
    $('throttled-' + which).textContent = data.throttled;
    $('limited-' + which).textContent = data.limited;
  }

  function render(a, b, ms) {
    $('error').hidden = true;
    const drawStarted = performance.now();
    summarize(a, 'a');
    summarize(b, 'b');
    draw(a, b);
    const drawMs = performance.now() - drawStarted;
    $('elapsed').textContent = ms.toFixed(0) + ' ms';
    $('draw').textContent = drawMs.toFixed(1) + ' ms';
    const d = document.body.dataset;
    d.peak = String(a.peak_per_slice);
    d.peakRetries = String(a.peak_retries_per_slice);
    d.peakB = String(b.peak_per_slice);
    d.peakRetriesB = String(b.peak_retries_per_slice);
    d.outageCalls = String(a.outage_calls);
    d.outageCallsB = String(b.outage_calls);
    d.probes = String(a.probes);
    d.probesB = String(b.probes);
    d.goodput = String(a.goodput_per_s);
    d.goodputB = String(b.goodput_per_s);
    d.servedP99 = String(a.served_p99_ms);
    d.servedP99B = String(b.served_p99_ms);
    d.throttled = String(a.throttled);
    d.throttledB = String(b.throttled);
    d.limited = String(a.limited);
    d.limitedB = String(b.limited);
    d.drawMs = drawMs.toFixed(1);
    d.renders = String(Number(d.renders || 0) + 1);
    d.state = 'ready';
  }

  async function fetchRun(which) {
    const response = await fetch('/api/sim?' + query(which).toString());
    return { ok: response.ok, status: response.status, body: await response.json() };
  }

  async function refresh() {
    const id = ++latest;
    document.body.dataset.state = 'loading';
    const started = performance.now();
    let a;
    let b;
    try {
      [a, b] = await Promise.all([fetchRun('a'), fetchRun('b')]);
    } catch (e) {
      if (id === latest) showError('The simulator did not answer: ' + e.message);
      return;
    }
    if (id !== latest) return;  // a newer request is on its way
    for (const r of [a, b]) {
      if (!r.ok) {
        showError('Bad parameter: ' + (r.body && r.body.error ? r.body.error : r.status));
        return;
      }
    }
    render(a.body, b.body, performance.now() - started);
  }

  function schedule() {
    clearTimeout(timer);
    timer = setTimeout(refresh, 30);
  }

  for (const f of fields) {
    const range = $(f);
    const box = $(f + '-value');
    range.addEventListener('input', () => { box.value = range.value; schedule(); });
    box.addEventListener('input', () => {
      if (box.value !== '' && Number(box.value) >= Number(range.min) &&
          Number(box.value) <= Number(range.max)) {
        range.value = box.value;
      }
      schedule();
    });
  }
  $('shared').addEventListener('change', schedule);
  for (const r of document.querySelectorAll('input[name="limits"]')) {
    r.addEventListener('change', schedule);
  }
  for (const t of toggles) {
    $(t).addEventListener('change', schedule);
    $('b_' + t).addEventListener('change', schedule);
  }
  window.addEventListener('resize', () => { if (plot) plot.setSize({ width: $('chart').clientWidth, height: 420 }); });
  refresh();
})();
