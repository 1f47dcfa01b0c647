//! The `guestmem-lab vm` engine runs end to end and reports every phase.

mod common;

use guestmem_lab::vm::guest::{GuestMode, Partition};
use guestmem_lab::vm::perf::{run, PerfConfig};

#[test]
fn perf_run_small_reports_every_pass_with_exact_dirty_pages() {
    if !common::kvm_usable() {
        return;
    }
    let config = PerfConfig {
        memory_bytes: 64 << 20,
        vcpus: 2,
        slots: 8,
        passes: 2,
        partition: Partition::Contiguous,
        ..PerfConfig::default()
    };

    let report = run(&config).unwrap();

    assert_eq!(report.passes.len(), 2);
    assert_eq!(report.passes[0].iteration, 2);
    for p in &report.passes {
        assert_eq!(p.dirty_pages, (64 << 20) / 4096);
        assert!(p.dirty_memory_secs > 0.0);
    }
    assert!(report.populate_memory_secs > 0.0);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["vcpus"], 2);
    assert!(json["avg_get_dirty_log_secs"].is_number());
    assert!(report.to_string().contains("Iteration 3 dirty memory time"));
}

#[test]
fn perf_run_memory_beyond_32_bit_reach_is_refused() {
    let config = PerfConfig {
        memory_bytes: 8 << 30,
        mode: GuestMode::Protected32,
        ..PerfConfig::default()
    };
    let e = run(&config).unwrap_err();
    assert!(e.to_string().contains("reaches below"), "{e}");
}

#[test]
fn perf_run_long_mode_small_matches_written_pages() {
    if !common::kvm_usable() {
        return;
    }
    let config = PerfConfig {
        memory_bytes: 32 << 20,
        vcpus: 2,
        slots: 4,
        passes: 1,
        mode: GuestMode::Long64,
        ..PerfConfig::default()
    };
    let report = run(&config).unwrap();
    assert_eq!(report.passes[0].dirty_pages, (32 << 20) / 4096);
}
