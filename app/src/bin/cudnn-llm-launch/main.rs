//! Starts one process per rank on this host, the way `torchrun` does, for binaries that take ranks as
//! processes (`cudnn_llm::llama::nccl::rendezvous`):
//!
//! ```text
//! cudnn-llm-launch --nproc 2 -- generate --model DIR --prompt "..." --tp 2
//! cudnn-llm-launch --nnodes 2 --node-rank 0 --nproc 8 --master-addr node0 -- ...   # on each host
//! ```
//!
//! Each rank gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
//! `MASTER_PORT` (a free port of this host when one host runs the job and none is given). Ranks share
//! the launcher's stdout and stderr. When a rank fails (a non-zero exit or a signal) the launcher says
//! which, ends the others (SIGTERM, then SIGKILL after `--grace` seconds) and exits with the failed
//! rank's code; when it is itself killed, the ranks get SIGKILL from the kernel (a parent-death signal),
//! so no rank outlives it.

use clap::Parser;
use std::process::{Child, Command, ExitCode, ExitStatus};
use std::time::{Duration, Instant};

/// One process per rank, started as torchrun starts them.
#[derive(Parser, Debug)]
#[command(name = "cudnn-llm-launch", version)]
struct Args {
    /// Ranks on this host (its GPUs).
    #[arg(long, value_name = "N")]
    nproc: usize,
    /// Hosts in the job.
    #[arg(long, default_value_t = 1, value_name = "M")]
    nnodes: usize,
    /// This host's index, 0..nnodes (its ranks are node_rank · nproc + 0..nproc).
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Rank 0's host, as the others reach it (required with more than one host).
    #[arg(long)]
    master_addr: Option<String>,
    /// The port rank 0 listens on (one host: a free port when not given).
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds the other ranks get to end after a rank failed, before SIGKILL.
    #[arg(long, default_value_t = 10.0)]
    grace: f64,
    /// The command each rank runs, and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    command: Vec<String>,
}

/// The most ranks one host starts.
const MAX_NPROC: usize = 1024;

fn main() -> ExitCode {
    let args = Args::parse();
    match plan(&args) {
        Ok(env) => run(&args, env),
        Err(e) => {
            eprintln!("cudnn-llm-launch: {e}");
            ExitCode::from(2)
        }
    }
}

/// What every rank of this host shares: (world size, first rank here, master address, master port).
fn plan(a: &Args) -> Result<(usize, usize, String, u16), String> {
    if a.nproc == 0 || a.nproc > MAX_NPROC {
        return Err(format!("--nproc {}: give 1 to {MAX_NPROC} ranks", a.nproc));
    }
    if a.nnodes == 0 || a.node_rank >= a.nnodes {
        return Err(format!("--node-rank {} is not below --nnodes {}", a.node_rank, a.nnodes));
    }
    let world = a
        .nnodes
        .checked_mul(a.nproc)
        .filter(|&w| w <= cudnn_llm::llama::nccl::rendezvous::MAX_WORLD)
        .ok_or_else(|| format!("--nnodes {} x --nproc {} ranks is too many", a.nnodes, a.nproc))?;
    if !(a.grace.is_finite() && (0.0..=3600.0).contains(&a.grace)) {
        return Err(format!("--grace {}: give 0 to 3600 seconds", a.grace));
    }
    let addr = match (&a.master_addr, a.nnodes) {
        (Some(addr), _) if !addr.trim().is_empty() => addr.trim().to_string(),
        (Some(_), _) => return Err("--master-addr is empty".into()),
        (None, 1) => "127.0.0.1".into(),
        (None, _) => return Err("--master-addr: name rank 0's host (more than one host runs the job)".into()),
    };
    let port = match (a.master_port, a.nnodes) {
        (Some(0), _) => return Err("--master-port 0: give a port".into()),
        (Some(p), _) => p,
        (None, 1) => free_port().map_err(|e| format!("no free port on this host: {e}"))?,
        (None, _) => {
            return Err("--master-port: give the port rank 0 listens on (every host the same)".into())
        }
    };
    Ok((world, a.node_rank * a.nproc, addr, port))
}

/// A port the system gives out now (free again when this returns; rank 0 binds it shortly after).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn run(a: &Args, (world, first, addr, port): (usize, usize, String, u16)) -> ExitCode {
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..a.nproc {
        let rank = first + local;
        let mut cmd = Command::new(&a.command[0]);
        cmd.args(&a.command[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string());
        // SAFETY: between fork and exec the child makes only async-signal-safe calls (setpgid, prctl,
        // getppid, _exit): its own process group (so that ending a rank ends what it started), a
        // parent-death signal, and an exit if the launcher died before the signal was armed.
        unsafe {
            let parent = libc::getpid();
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setpgid(0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                eprintln!("cudnn-llm-launch: rank {rank}: cannot start {}: {e}", a.command[0]);
                end(&mut children, Duration::from_secs_f64(a.grace));
                return ExitCode::from(1);
            }
        }
    }
    let grace = Duration::from_secs_f64(a.grace);
    loop {
        let mut failed = None;
        let mut running = 0;
        for (rank, child) in children.iter_mut() {
            match child.try_wait() {
                Ok(None) => running += 1,
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    failed = Some((*rank, describe(status), code(status)));
                    break;
                }
                Err(e) => {
                    failed = Some((*rank, format!("cannot be waited for: {e}"), 1));
                    break;
                }
            }
        }
        if let Some((rank, what, exit)) = failed {
            say(&format!("cudnn-llm-launch: rank {rank} {what}; ending the other ranks"));
            end(&mut children, grace);
            return ExitCode::from(exit);
        }
        if running == 0 {
            return ExitCode::SUCCESS;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `line` and a newline on stderr in one write, so that it does not interleave with the ranks' lines.
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// SIGTERM to every rank's process group (the rank and what it started), SIGKILL to the groups of
/// ranks left after `grace`; waits for the ranks.
fn end(children: &mut [(usize, Child)], grace: Duration) {
    signal_groups(children, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        let mut running = Vec::new();
        for (r, c) in children.iter_mut() {
            if matches!(c.try_wait(), Ok(None)) {
                running.push(*r);
            }
        }
        if running.is_empty() {
            // What the ranks started and left behind.
            signal_groups(children, libc::SIGKILL);
            return;
        }
        if Instant::now() >= deadline {
            say(&format!("cudnn-llm-launch: rank(s) {running:?} still running after {grace:.0?}: SIGKILL"));
            signal_groups(children, libc::SIGKILL);
            for (_, c) in children.iter_mut() {
                let _ = c.wait();
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `signal` to each rank's process group (its pid: each rank leads its own group).
fn signal_groups(children: &[(usize, Child)], signal: libc::c_int) {
    for (_, c) in children {
        let Ok(group) = libc::pid_t::try_from(c.id()) else { continue };
        // SAFETY: kill only sends a signal. The group id is a rank's pid; Linux does not hand out a pid
        // while a process group of that id has members, so the signal reaches the rank's group or
        // no one (ESRCH).
        unsafe { libc::kill(-group, signal) };
    }
}

fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".into(),
    }
}

/// The launcher's exit code for a failed rank's status: its code, or 128 + its signal as a shell says.
fn code(s: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).ok().filter(|&c| c != 0).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        _ => 1,
    }
}
