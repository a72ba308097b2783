//! Where a process's start-up goes: a process-wide record of the phases between `exec` and the first
//! result (opening the driver and context, the cuDNN and cuBLAS handles, compiling or loading the
//! kernels, building or loading plans; the model crate adds reading and uploading weights), that a
//! caller reads with [`phases`] and prints as it likes (`generate` prints it as one line).
//!
//! Each phase accumulates: a phase that happens twice (two contexts, many plans) sums its time and
//! counts its occurrences, with the detail of its latest occurrence.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One phase of start-up, summed over its occurrences.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Phase {
    /// What it was, e.g. `kernels`.
    pub name: &'static str,
    /// Time spent in it, summed over occurrences.
    pub took: Duration,
    /// How many times it happened.
    pub count: u32,
    /// What its latest occurrence says about itself, e.g. `11 compiled, 0 loaded from disk`.
    pub detail: String,
}

static PHASES: Mutex<Vec<Phase>> = Mutex::new(Vec::new());

/// Adds `took` to the phase called `name` (created on its first occurrence, in order of first
/// occurrence), with `detail` as its latest detail (kept when empty).
pub fn record(name: &'static str, took: Duration, detail: impl Into<String>) {
    let detail = detail.into();
    let mut phases = PHASES.lock().unwrap_or_else(|p| p.into_inner());
    match phases.iter_mut().find(|p| p.name == name) {
        Some(p) => {
            p.took += took;
            p.count += 1;
            if !detail.is_empty() {
                p.detail = detail;
            }
        }
        None => phases.push(Phase { name, took, count: 1, detail }),
    }
}

/// Runs `f`, recording its time under `name` with the detail `detail` computes from its result.
pub fn timed<R>(name: &'static str, f: impl FnOnce() -> R, detail: impl FnOnce(&R) -> String) -> R {
    let t = Instant::now();
    let r = f();
    record(name, t.elapsed(), detail(&r));
    r
}

/// Every phase recorded so far, in order of first occurrence.
pub fn phases() -> Vec<Phase> {
    PHASES.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Time since this process started (the kernel's record of its start, to its clock tick of 10 ms),
/// where the system says (Linux); `None` elsewhere.
pub fn since_process_start() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
    let after = &stat[stat.rfind(')')? + 1..];
    let start_ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let up: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    // /proc counts in USER_HZ, which Linux fixes at 100 on x86-64 and aarch64.
    Some(Duration::from_secs_f64((up - start_ticks / 100.0).max(0.0)))
}

/// The record as one line, e.g. `context 212 ms, handles 1.31 s, kernels 40 ms (11 loaded)`.
pub fn summary() -> String {
    phases()
        .iter()
        .map(|p| {
            let n = if p.count > 1 { format!(" x{}", p.count) } else { String::new() };
            let d = if p.detail.is_empty() { String::new() } else { format!(" ({})", p.detail) };
            format!("{} {}{n}{d}", p.name, millis(p.took))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// `812 ms` or `1.31 s`.
pub fn millis(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{:.0} ms", d.as_secs_f64() * 1e3)
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_accumulate_in_order_of_first_occurrence() {
        // Other tests of this process may record phases too: only these names are checked.
        record("test phase a", Duration::from_millis(5), "first");
        record("test phase b", Duration::from_millis(1), "");
        record("test phase a", Duration::from_millis(7), "");
        let v = phases();
        let a = v.iter().position(|p| p.name == "test phase a").unwrap();
        let b = v.iter().position(|p| p.name == "test phase b").unwrap();
        assert!(a < b);
        assert_eq!((v[a].took, v[a].count, v[a].detail.as_str()), (Duration::from_millis(12), 2, "first"));
        assert!(summary().contains("test phase a 12 ms x2 (first)"), "{}", summary());
        let x = timed("test phase c", || 41 + 1, |r| format!("got {r}"));
        assert_eq!(x, 42);
        assert!(phases().iter().any(|p| p.name == "test phase c" && p.detail == "got 42"));
        assert_eq!(millis(Duration::from_millis(1310)), "1.31 s");
    }

    #[test]
    fn the_process_started_before_now_and_not_long_ago() {
        let age = since_process_start();
        if cfg!(target_os = "linux") {
            let age = age.expect("/proc/self/stat and /proc/uptime are read on Linux");
            assert!(age < Duration::from_secs(24 * 3600), "{age:?}");
            std::thread::sleep(Duration::from_millis(30));
            assert!(
                since_process_start().unwrap() + Duration::from_millis(15) >= age,
                "the age goes forward"
            );
        }
    }
}
