//! The translate scenario, run tiny: structure of its JSON and Markdown, and that every way of
//! looking up found the right region for every lookup (the scenario checks each thread's sum
//! of region starts and fails otherwise). No timing is asserted.

use guestmem_lab::report::{write_run, LabReport};
use guestmem_lab::run::{Order, Protocol};
use guestmem_lab::translate::{
    run_translate, LookupKind, Pattern, TranslateLabConfig, LOOKUPS_PER_VISIT,
};

fn tiny() -> TranslateLabConfig {
    TranslateLabConfig {
        region_counts: vec![1, 3, 8],
        threads: vec![1, 2],
        lookups_per_thread: 16 * LOOKUPS_PER_VISIT,
        patterns: vec![Pattern::Own, Pattern::Scattered],
        protocol: Protocol {
            warmup: 0,
            rounds: 1,
            order: Order::Fixed,
        },
        command: "test".into(),
    }
}

#[test]
fn translate_tiny_every_kind_and_thread_count_runs_with_right_answers() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_translate(&tiny()).expect("every lookup found its region");

    let counts: Vec<usize> = result
        .body
        .region_counts
        .iter()
        .map(|r| r.regions)
        .collect();
    assert_eq!(counts, [1, 3, 8]);
    for rc in &result.body.region_counts {
        let names: Vec<&str> = rc.variants.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "guestmem-translator-own-1",
                "guestmem-snapshot-own-1",
                "vm-memory-own-1",
                "guestmem-translator-own-2",
                "guestmem-snapshot-own-2",
                "vm-memory-own-2",
                "guestmem-translator-scattered-1",
                "guestmem-snapshot-scattered-1",
                "vm-memory-scattered-1",
                "guestmem-translator-scattered-2",
                "guestmem-snapshot-scattered-2",
                "vm-memory-scattered-2",
            ]
        );
        for v in &rc.variants {
            let s = &v.samples[0].sample;
            assert_eq!(s.thread_ns_per_lookup.len(), v.threads, "{}", v.name);
            assert!(
                s.ns_per_lookup > 0.0 && s.lookups_per_sec > 0.0,
                "{}",
                v.name
            );
            if v.kind == LookupKind::VmMemory {
                assert_eq!(v.speedup_vs_vm_memory, 1.0);
            }
        }
    }
}

#[test]
fn translate_lookups_not_a_whole_number_of_visits_is_refused() {
    let _serial = guestmem_testkit::host_lock();
    let cfg = TranslateLabConfig {
        lookups_per_thread: LOOKUPS_PER_VISIT + 1,
        ..tiny()
    };
    assert!(run_translate(&cfg).is_err());
}

#[test]
fn translate_tiny_writes_json_and_markdown_run_folder() {
    let _serial = guestmem_testkit::host_lock();
    let cfg = TranslateLabConfig {
        region_counts: vec![4],
        ..tiny()
    };
    let result = run_translate(&cfg).expect("scenario runs");
    let base = std::env::temp_dir().join(format!("guestmem-lab-translate-{}", std::process::id()));

    let dir = write_run(&result, &base).expect("run folder written");

    assert!(dir.to_string_lossy().ends_with("-translate"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
    assert_eq!(json["scenario"], "translate");
    assert_eq!(json["seeds"], serde_json::json!(["004"]));
    assert!(json["run"].get("git_commit").is_some());
    let v = &json["region_counts"][0]["variants"][0];
    assert_eq!(v["kind"], "guestmem-translator");
    for key in ["ns_per_lookup", "lookups_per_sec", "speedup_vs_vm_memory"] {
        assert!(v.get(key).is_some(), "variant.{key}");
    }
    let svg = std::fs::read_to_string(dir.join("plot.svg")).expect("plot written");
    assert!(svg.starts_with("<svg"));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert_eq!(md, result.markdown());
    assert!(md.contains("## 4 region(s)"));
    assert!(md.contains("| vm-memory-scattered-2 | 2 |"));
    std::fs::remove_dir_all(&base).unwrap();
}
