//! Runs `guestmem::kvm::perf` once and prints its report, then the JSON.
//!
//! `cargo run --release -p guestmem --example vm_perf -- [MiB] [vCPUs] [slots] [passes] [per-slot|contiguous] [long]`
//! (defaults: 256 4 64 3 contiguous, 32-bit guest).

use guestmem::kvm::guest::{GuestMode, Partition};
use guestmem::kvm::perf::{run, PerfConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, default: u64| -> u64 {
        args.get(i)
            .map(|a| a.parse().expect("arguments are numbers"))
            .unwrap_or(default)
    };
    let config = PerfConfig {
        memory_bytes: num(0, 256) << 20,
        vcpus: num(1, 4) as usize,
        slots: num(2, 64) as usize,
        passes: num(3, 3) as usize,
        partition: if args.get(4).is_some_and(|a| a == "per-slot") {
            Partition::PerSlot
        } else {
            Partition::Contiguous
        },
        mode: if args.get(5).is_some_and(|a| a == "long") {
            GuestMode::Long64
        } else {
            GuestMode::Protected32
        },
        ..PerfConfig::default()
    };
    match run(&config) {
        Ok(report) => {
            print!("{report}");
            println!(
                "{}",
                serde_json::to_string_pretty(&report).expect("serializable")
            );
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
