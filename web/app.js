// The storm explorer: every change of a control asks /api/sim (keel::sim in C++) for a new run
// and redraws the chart. Requests are debounced, and a late answer never overwrites a newer one.
(function () {
  'use strict';
  const fields = ['fleet', 'capacity', 'outage_s', 'attempts', 'base_ms'];
  const toggles = ['jitter', 'budget', 'breaker'];
  const $ = (id) => document.getElementById(id);
  let plot = null;
  let latest = 0;
  let timer = null;

  function query() {
    const params = new URLSearchParams();
    for (const f of fields) params.set(f, $(f + '-value').value.trim());
    for (const t of toggles) params.set(t, $(t).checked ? '1' : '0');
    return params;
  }

  function showError(message) {
    const box = $('error');
    box.textContent = message;
    box.hidden = false;
    document.body.dataset.state = 'error';
  }

  function draw(data) {
    const s = data.series;
    const width = Math.max(400, $('chart').clientWidth);
    const opts = {
      width: width,
      height: 420,
      title: 'calls per 100 ms slice',
      scales: { x: { time: false } },
      axes: [{ label: 'time (s)' }, { label: 'calls', size: 60 }],
      series: [
        { label: 't (s)' },
        { label: 'all calls', stroke: '#4477aa', fill: 'rgba(68,119,170,0.25)',
          paths: uPlot.paths.stepped({ align: 1 }) },
        { label: 'retries', stroke: '#cc3311', paths: uPlot.paths.stepped({ align: 1 }) },
        { label: 'successes', stroke: '#228833', paths: uPlot.paths.stepped({ align: 1 }) },
      ],
    };
    const rows = [s.t_s, s.offered, s.retries, s.successes];
    if (plot) plot.destroy();
    plot = new uPlot(opts, rows, $('chart'));
  }

  function render(data, ms) {
    $('error').hidden = true;
    $('policy').textContent = data.policy;
    $('peak').textContent = data.peak_per_slice;
    $('peak-retries').textContent = data.peak_retries_per_slice;
    $('total').textContent = data.total_calls;
    $('amplification').textContent = data.amplification.toFixed(2) + 'x';
    $('ops').textContent = data.ops_succeeded + ' / ' + data.ops_failed;
    $('elapsed').textContent = ms.toFixed(0) + ' ms';
    draw(data);
    document.body.dataset.peak = String(data.peak_per_slice);
    document.body.dataset.peakRetries = String(data.peak_retries_per_slice);
    document.body.dataset.renders = String(Number(document.body.dataset.renders || 0) + 1);
    document.body.dataset.state = 'ready';
  }

  async function refresh() {
    const id = ++latest;
    document.body.dataset.state = 'loading';
    const started = performance.now();
    let response;
    let body;
    try {
      response = await fetch('/api/sim?' + query().toString());
      body = await response.json();
    } catch (e) {
      if (id === latest) showError('The simulator did not answer: ' + e.message);
      return;
    }
    if (id !== latest) return;  // a newer request is on its way
    if (!response.ok) {
      showError('Bad parameter: ' + (body && body.error ? body.error : response.status));
      return;
    }
    render(body, performance.now() - started);
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
  for (const t of toggles) $(t).addEventListener('change', schedule);
  window.addEventListener('resize', () => { if (plot) plot.setSize({ width: $('chart').clientWidth, height: 420 }); });
  refresh();
})();
