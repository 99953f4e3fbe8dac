"""The SM clock and board power the GPU held while each timed loop ran, read with nvidia-smi.

Why a record keeps them: on the H200 both mok's forward and the dense GEMM it is compared with
run at the 700 W power cap, where the SM clock the power management settles on, not the
nominal boost clock, sets what any kernel can reach. With the clock of each timed window in
the record, its rates can be read against the tensor cores' peak at that clock (sms x dense
FLOPs per SM per clock x clock), and a run on a machine that held a lower clock shows as such.

`Sampler` runs `nvidia-smi --query-gpu=... --loop-ms=N` beside the timed programs and keeps every
line; each line carries nvidia-smi's own timestamp, so output buffered by the pipe does not
move a sample in time. `window_summary` takes the samples inside one timed window (the
programs write their windows as Unix times: mok.json `timing.window_unix_s`, peer.json
`forward.window_unix_s` and the like). This only reads: it never sets clocks, power limits or
any other setting of the card.
"""
import bisect
import datetime
import shutil
import statistics
import subprocess
import threading

# (record key, nvidia-smi field names in order of preference: drivers renamed some).
FIELDS = (
    ("timestamp", ("timestamp",)),
    ("index", ("index",)),
    ("sm_mhz", ("clocks.sm",)),
    ("power_w", ("power.draw.instant", "power.draw")),
    ("sw_power_cap", ("clocks_event_reasons.sw_power_cap", "clocks_throttle_reasons.sw_power_cap")),
    ("hw_slowdown", ("clocks_event_reasons.hw_slowdown", "clocks_throttle_reasons.hw_slowdown")),
)
REQUIRED = ("timestamp", "index", "sm_mhz")
DEFAULT_PERIOD_MS = 10

# Dense (no sparsity) BF16 tensor-core FLOPs per SM per clock, by compute capability, from
# NVIDIA's published peaks: A100 SXM 312 TFLOP/s = 108 SMs x 2048 x 1410 MHz; H100/H200 SXM
# 989.4 TFLOP/s = 132 SMs x 4096 x 1830 MHz. Capabilities not listed give no peak.
DENSE_BF16_FLOPS_PER_SM_CLOCK = {"8.0": 2048, "9.0": 4096}


def parse_timestamp(text):
    """nvidia-smi's `timestamp` ("2026/12/04 03:50:12.345", local time) as Unix seconds."""
    return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def parse_value(key, text):
    """One CSV cell: a float for clocks and power, a bool for the event reasons ("Active" /
    "Not Active"), an int index; None for "[N/A]", "[Not Supported]" and the like."""
    text = text.strip()
    if not text or text.startswith("[") or text.upper() in ("N/A", "NOT SUPPORTED"):
        return None
    if key == "timestamp":
        return parse_timestamp(text)
    if key == "index":
        return int(text)
    if key in ("sw_power_cap", "hw_slowdown"):
        return {"active": True, "not active": False}.get(text.lower())
    return float(text)


_probed = {}  # nvidia-smi path -> probe_fields' answer (a run.py sweep samples once per record)


def probe_fields(smi, run=subprocess.run):
    """{key: field name} of the fields this nvidia-smi answers (a field it does not know makes
    the query exit non-zero), asked once per path and process. Raises RuntimeError when a
    required one is missing."""
    if smi not in _probed:
        _probed[smi] = _probe(smi, run)
    return dict(_probed[smi])


def _probe(smi, run):
    chosen = {}
    for key, names in FIELDS:
        for name in names:
            try:
                r = run([smi, f"--query-gpu={name}", "--format=csv,noheader,nounits"], capture_output=True,
                        text=True, timeout=30)
            except (OSError, subprocess.SubprocessError):
                continue
            if r.returncode == 0 and r.stdout.strip():
                chosen[key] = name
                break
    missing = [" or ".join(names) for key, names in FIELDS if key in REQUIRED and key not in chosen]
    if missing:
        raise RuntimeError(f"{smi} does not answer the field(s) {', '.join(missing)}")
    return chosen


class Sampler:
    """nvidia-smi sampling in the background, from start() to stop(); `samples` is a list of
    dicts {"t": Unix seconds, "index", "sm_mhz", "power_w", "sw_power_cap", "hw_slowdown"}
    (a field the driver does not answer is absent), `error` says why there are none."""

    def __init__(self, period_ms=DEFAULT_PERIOD_MS, smi="nvidia-smi"):
        self.period_ms = period_ms
        self.smi = smi
        self.samples = []
        self.error = None
        self.fields = None
        self._proc = None
        self._thread = None
        self._lock = threading.Lock()

    def start(self):
        exe = shutil.which(self.smi)
        if exe is None:
            self.error = f"{self.smi} not found"
            return self
        try:
            self.fields = probe_fields(exe)
        except RuntimeError as exc:
            self.error = str(exc)
            return self
        keys = list(self.fields)
        cmd = [exe, "--query-gpu=" + ",".join(self.fields[k] for k in keys), "--format=csv,noheader,nounits",
               f"--loop-ms={int(self.period_ms)}"]
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError as exc:
            self.error = f"{exe}: {exc}"
            return self
        self._thread = threading.Thread(target=self._read, args=(keys,), daemon=True)
        self._thread.start()
        return self

    def _read(self, keys):
        for line in self._proc.stdout:
            cells = line.rstrip("\n").split(",")
            if len(cells) != len(keys):
                continue  # a partial line or a message, not a sample
            try:
                vals = {k: parse_value(k, c) for k, c in zip(keys, cells)}
            except ValueError:
                continue
            if vals.get("timestamp") is None:
                continue
            vals["t"] = vals.pop("timestamp")
            with self._lock:
                self.samples.append(vals)

    def stop(self):
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._thread.join(timeout=10)
            self._proc.stdout.close()
            self._proc = None
            if not self.samples and self.error is None:
                self.error = "nvidia-smi gave no samples"
        with self._lock:
            return list(self.samples)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def _window(entry):
    """[start, end] Unix seconds from an entry's `window_unix_s`, or None."""
    w = entry.get("window_unix_s") if isinstance(entry, dict) else None
    if (isinstance(w, (list, tuple)) and len(w) == 2 and all(isinstance(x, (int, float)) for x in w)
            and w[0] <= w[1]):
        return float(w[0]), float(w[1])
    return None


def window_summary(samples, window, gpus=None):
    """The samples of GPUs `gpus` (all when None) inside `window` ([start, end] Unix seconds):
    {"samples", "sm_mhz_median", "sm_mhz_min", "sm_mhz_max", "power_w_median",
    "sw_power_cap_share", "hw_slowdown_share"} (a value None when no sample has it); None when
    there is no window. A window with no sample inside gives {"samples": 0}."""
    if window is None:
        return None
    lo, hi = window
    inside = [s for s in samples if lo <= s["t"] <= hi and (gpus is None or s.get("index") in gpus)]
    out = {"samples": len(inside), "window_s": hi - lo}
    if not inside:
        return out

    def col(key):
        return [s[key] for s in inside if s.get(key) is not None]

    mhz, watts = col("sm_mhz"), col("power_w")
    out.update({"sm_mhz_median": statistics.median(mhz) if mhz else None,
                "sm_mhz_min": min(mhz) if mhz else None, "sm_mhz_max": max(mhz) if mhz else None,
                "power_w_median": statistics.median(watts) if watts else None})
    for key in ("sw_power_cap", "hw_slowdown"):
        flags = col(key)
        out[key + "_share"] = sum(flags) / len(flags) if flags else None
    return out


def iteration_clock_pairs(samples, window, iters_ms, gpus=None):
    """(ms, sm_mhz) of each clock sample of GPUs `gpus` (all when None) that fell inside a timed
    iteration: the loop's iterations ran back to back from the window's start (checks.timed_window
    made the window so), iteration i spanning start + sum(iters_ms[:i]) .. + iters_ms[i]. One
    iteration may hold several samples (each gives a pair), a short one none. [] without a
    window, iteration times or clock samples."""
    if window is None or not iters_ms:
        return []
    lo, hi = window
    ends, t = [], lo
    for ms in iters_ms:
        t += float(ms) / 1e3
        ends.append(t)
    pairs = []
    for s in samples:
        if s.get("sm_mhz") is None or not lo <= s["t"] <= hi or (gpus is not None and s.get("index") not in gpus):
            continue
        i = bisect.bisect_left(ends, s["t"])
        if i < len(iters_ms):
            pairs.append((float(iters_ms[i]), float(s["sm_mhz"])))
    return pairs


def _spread(vals):
    """(90th - 10th percentile) / median: how far a loop's middle 80% spreads; None for a
    median of 0 (no spread to speak of relative to it)."""
    median = statistics.median(vals)
    if median <= 0:
        return None
    deciles = statistics.quantiles(vals, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / median


def clock_following(pairs):
    """Whether a timed loop's spread follows the SM clock, from iteration_clock_pairs' (ms, MHz):
    {"pairs", "ms_spread", "cycles_spread", "r_ms_vs_clock_period"}. A spread is (90th - 10th
    percentile) / median; "cycles" is an iteration's time x the clock sampled inside it (the
    clock cycles it took, if the clock held through it), so a loop whose iterations do the same
    work at whatever clock the power management sets has a cycles_spread far below its
    ms_spread and r (Pearson, ms against 1/MHz) near 1. None with fewer than 10 pairs (too few
    for deciles); r None when either side is constant. The figures are over the pairs, not the
    iterations: an iteration holding two samples counts twice, and a slow one holds more.
    Multiplying by a sampled clock (nvidia-smi's steps are ~15 MHz, and the clock may move
    within an iteration) adds noise of its own: a loop at a steady clock shows a cycles spread
    a few percent above its ms spread."""
    if len(pairs) < 10:
        return None
    ms = [p[0] for p in pairs]
    period = [1.0 / p[1] for p in pairs if p[1] > 0]
    if len(period) != len(pairs):
        return None
    cycles = [m * mhz for m, mhz in pairs]
    try:
        r = statistics.correlation(ms, period)
    except statistics.StatisticsError:  # (a constant side: no correlation to speak of)
        r = None
    return {"pairs": len(pairs), "ms_spread": _spread(ms), "cycles_spread": _spread(cycles),
            "r_ms_vs_clock_period": r}


def tensor_peak_tflops(capability, sms, mhz):
    """Dense BF16 tensor-core peak at clock `mhz` (TFLOP/s), or None when unknown."""
    per = DENSE_BF16_FLOPS_PER_SM_CLOCK.get(str(capability)) if capability is not None else None
    if per is None or not sms or not mhz:
        return None
    return float(sms) * per * float(mhz) * 1e6 / 1e12


def timed_windows(mok, peer):
    """{name: (start, end)} of the timed loops a record compares, from mok.json and peer.json."""
    peer = peer or {}
    ceilings = peer.get("ceilings") or {}
    found = {"mok_forward": _window(mok.get("timing") or {}),
             "pytorch_forward": _window(peer.get("forward") or {}),
             "pytorch_grouped_gemms": _window(peer.get("grouped_gemms") or {}),
             "dense_bf16_ceiling": _window(ceilings.get("dense_bf16") or {})}
    return {k: w for k, w in found.items() if w is not None}
