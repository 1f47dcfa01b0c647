//! The faults scenario, run tiny: structure of its JSON and Markdown, and what the kernel did:
//! every page faulted in, 4 KiB pages only, one VMA or one per thread. No timing is asserted.

use guestmem_lab::faults::{run_faults, FaultKind, FaultsLabConfig};
use guestmem_lab::report::{write_run, LabReport};
use guestmem_lab::run::{Order, Protocol};

const TINY_BYTES: u64 = 32 << 20;
const PAGE_BYTES: u64 = 4096;

fn tiny() -> FaultsLabConfig {
    FaultsLabConfig {
        size: TINY_BYTES,
        threads: vec![1, 2],
        protocol: Protocol {
            warmup: 0,
            rounds: 1,
            order: Order::Fixed,
        },
        command: "test".into(),
    }
}

#[test]
fn faults_tiny_every_page_faulted_in_small_pages_with_expected_vmas() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_faults(&tiny()).expect("scenario runs");

    let names: Vec<&str> = result
        .body
        .variants
        .iter()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "one-vma-touch-1",
            "vma-per-thread-touch-1",
            "one-vma-populate-1",
            "one-vma-touch-2",
            "vma-per-thread-touch-2",
            "one-vma-populate-2",
        ]
    );
    for v in &result.body.variants {
        let s = &v.samples[0].sample;
        assert_eq!(s.pages, TINY_BYTES / PAGE_BYTES, "{}", v.name);
        assert_eq!(s.resident, TINY_BYTES, "{}: every page resident", v.name);
        assert_eq!(s.huge, 0, "{}: MADV_NOHUGEPAGE keeps 4 KiB pages", v.name);
        assert_eq!(s.thread_seconds.len(), v.threads, "{}", v.name);
        let vmas = match v.kind {
            FaultKind::VmaPerThreadTouch => v.threads,
            _ => 1,
        };
        assert_eq!(s.vmas, vmas, "{}", v.name);
        if v.kind != FaultKind::OneVmaPopulate {
            // A user-mode write to a fresh page is one minor fault.
            assert!(
                s.minor_faults >= s.pages,
                "{}: {} faults",
                v.name,
                s.minor_faults
            );
        }
    }
    assert_eq!(result.body.variants[0].scaling_vs_1_thread, 1.0);
}

#[test]
fn faults_size_that_does_not_split_is_refused() {
    let _serial = guestmem_testkit::host_lock();
    let cfg = FaultsLabConfig {
        size: 3 * PAGE_BYTES,
        ..tiny()
    };
    assert!(run_faults(&cfg).is_err());
}

#[test]
fn faults_tiny_writes_json_and_markdown_run_folder() {
    let _serial = guestmem_testkit::host_lock();
    let cfg = FaultsLabConfig {
        threads: vec![2],
        ..tiny()
    };
    let result = run_faults(&cfg).expect("scenario runs");
    let base = std::env::temp_dir().join(format!("guestmem-lab-faults-{}", std::process::id()));

    let dir = write_run(&result, &base).expect("run folder written");

    assert!(dir.to_string_lossy().ends_with("-faults"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
    assert_eq!(json["scenario"], "faults");
    assert_eq!(json["seeds"], serde_json::json!(["002"]));
    assert!(json["run"].get("kernel").is_some());
    assert_eq!(json["settings"]["threads"], serde_json::json!([2]));
    let v = &json["variants"][1];
    assert_eq!(v["kind"], "vma-per-thread-touch");
    for key in ["seconds", "faults_per_sec_at_median", "scaling_vs_1_thread"] {
        assert!(v.get(key).is_some(), "variant.{key}");
    }
    let svg = std::fs::read_to_string(dir.join("plot.svg")).expect("plot written");
    assert!(svg.starts_with("<svg"));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert_eq!(md, result.markdown());
    assert!(md.contains("| vma-per-thread-touch-2 | 2 | 2 |"));
    std::fs::remove_dir_all(&base).unwrap();
}
