//! `guestmem serve-ctl`: one command to a running `guestmem serve-uffd --control PATH`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args as ClapArgs, ValueEnum};

/// Flags of `guestmem serve-ctl`.
#[derive(ClapArgs)]
pub struct Args {
    /// The server's control socket (its --control).
    #[arg(long)]
    control: PathBuf,
    /// What to ask.
    #[arg(value_enum)]
    command: Ctl,
}

#[derive(Clone, Copy, ValueEnum)]
enum Ctl {
    /// Every VM served and every socket's totals, as JSON.
    Status,
    /// Whether it serves (JSON).
    Health,
    /// Stop accepting, graduate every VM, exit.
    Drain,
    /// The Prometheus text.
    Metrics,
}

/// Sends the command and prints the answer.
pub fn run(a: Args) -> Result<()> {
    let word = match a.command {
        Ctl::Status => "status",
        Ctl::Health => "health",
        Ctl::Drain => "drain",
        Ctl::Metrics => "metrics",
    };
    let mut s = UnixStream::connect(&a.control)
        .with_context(|| format!("connect to {}", a.control.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("{word}\n").as_bytes())?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    if reply.is_empty() {
        bail!("{} closed without an answer", a.control.display());
    }
    print!("{reply}");
    Ok(())
}
