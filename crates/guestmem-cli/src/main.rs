//! The `guestmem` command: parses flags, builds library objects, prints. All work is in the
//! `guestmem` library.

mod bringup;
mod lab;
mod report;
mod vm;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Bring up, inspect and exercise guest memory the way a VMM would.
#[derive(Parser)]
#[command(name = "guestmem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Map a guest memory layout, populate (and pin) it in parallel, verify and report.
    Bringup(bringup::Args),
    /// Run vCPUs against the map as KVM memslots and time dirty-log passes, like KVM's
    /// dirty_log_perf_test.
    Vm(vm::Args),
    /// Run a lab scenario beside the peers; write a run folder and print its table.
    Lab(lab::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bringup(args) => bringup::run(args),
        Command::Vm(args) => vm::run(args),
        Command::Lab(args) => lab::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed pipe (`guestmem ... | head`) is not an error worth reporting.
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            let _ = writeln!(std::io::stderr(), "guestmem: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
