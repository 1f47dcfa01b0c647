//! `guestmem-lab`: the lab's command, apart from the operator's `guestmem`. It runs each
//! seed's experiment as a scenario beside the peers (`guestmem-lab populate`, ...,
//! `guestmem-lab all`) and the KVM guest workload (`guestmem-lab vm`). It links the lab's
//! instruments and test rigs (the Firecracker stand-in, guestmem's `lab-internals`), which
//! the `guestmem` an operator installs never carries.

mod scenarios;
mod vm;

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Measure guestmem beside the way QEMU, Cloud Hypervisor and Firecracker do it.
#[derive(Parser)]
#[command(name = "guestmem-lab", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Scenario(scenarios::Scenario),
    /// Run vCPUs against the map as KVM memslots and time dirty-log passes, like KVM's
    /// dirty_log_perf_test.
    Vm(vm::Args),
}

/// Writes `value` as pretty JSON and a newline. Serialised first, then written: a closed
/// pipe then comes back as an `io::Error` of kind `BrokenPipe`, which `main` ends quietly.
fn write_json(w: &mut impl Write, value: &impl serde::Serialize) -> anyhow::Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    w.write_all(text.as_bytes())?;
    Ok(())
}

fn main() -> ExitCode {
    if let Err(e) = guestmem_lab::stop::clean_up_on_signals() {
        let _ = writeln!(std::io::stderr(), "guestmem-lab: error: take signals: {e}");
        return ExitCode::FAILURE;
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Scenario(s) => scenarios::run(s),
        Command::Vm(args) => vm::run(args),
    };
    // Stopped by a signal meanwhile (the scenario failed as its children were killed):
    // the run ends by the signal, once its clean-up is done.
    guestmem_lab::stop::wait_if_stopping();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return ExitCode::SUCCESS;
            }
            let _ = writeln!(std::io::stderr(), "guestmem-lab: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
