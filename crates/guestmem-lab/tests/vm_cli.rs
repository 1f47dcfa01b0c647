//! The real `guestmem-lab vm` command, end to end, against /dev/kvm.

use std::path::Path;
use std::process::Command;

#[test]
fn vm_json_reports_every_pass_with_exact_dirty_pages() {
    if let Some(why) = guestmem::kvm::unavailable_reason(Path::new("/dev/kvm")) {
        guestmem_testkit::skip(format_args!("{why}"));
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
        .args([
            "vm", "--size", "64M", "--slots", "8", "--vcpus", "2", "--passes", "2", "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let passes = v["passes"].as_array().unwrap();
    assert_eq!(passes.len(), 2);
    for p in passes {
        // Every 4 KiB page of the 64 MiB was written once per pass, and the log says so.
        assert_eq!(p["dirty_pages"], 64u64 << 20 >> 12);
    }
    assert!(v["populate_memory_secs"].as_f64().unwrap() > 0.0);
}

#[test]
fn vm_refuses_a_split_that_does_not_fit() {
    let out = Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
        .args(["vm", "--size", "64M", "--slots", "100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("100 slots"));
}

#[test]
fn vm_prefault_modes_report_prefault_and_guest_start() {
    if let Some(why) = guestmem::kvm::unavailable_reason(Path::new("/dev/kvm")) {
        guestmem_testkit::skip(format_args!("{why}"));
        return;
    }
    for mode in ["none", "blocking", "background"] {
        let out = Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
            .args([
                "vm", "--size", "64M", "--slots", "4", "--vcpus", "2", "--passes", "1",
            ])
            .args(["--prefault", mode, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["prefault"], mode);
        let f = |k: &str| v[k].as_f64().unwrap();
        assert_eq!(f("prefault_secs") > 0.0, mode != "none", "{mode}");
        assert!(f("guest_start_secs") > 0.0, "{mode}");
        assert!(
            f("first_pass_done_secs") >= f("populate_memory_secs"),
            "{mode}"
        );
        // Every page was still written and logged on the pass after.
        assert_eq!(v["passes"][0]["dirty_pages"], 64u64 << 20 >> 12, "{mode}");
    }
}
