//! The guards scenario, run tiny: structure of its JSON and Markdown, and what the kernel did
//! with each layout's huge pages. No timing is asserted.

use guestmem_lab::guards::{run_guards, GuardsLabConfig, MIN_REGION_BYTES};
use guestmem_lab::report::{write_run, LabReport};
use guestmem_lab::run::{Order, Protocol};

const TINY_BYTES: u64 = 16 << 20;
const THP_BYTES: u64 = 2 << 20;
const VARIANTS: [&str; 4] = [
    "guestmem-guards",
    "guestmem-noguard",
    "tcg-style",
    "unaligned",
];

fn tiny() -> GuardsLabConfig {
    GuardsLabConfig {
        size: TINY_BYTES,
        protocol: Protocol {
            warmup: 0,
            rounds: 1,
            order: Order::Fixed,
        },
        command: "test".into(),
        ..GuardsLabConfig::default()
    }
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .is_ok_and(|s| !s.contains("[never]"))
}

#[test]
fn guards_tiny_guestmem_covers_its_span_and_tcg_guard_costs_a_huge_page() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_guards(&tiny()).expect("scenario runs");

    let names: Vec<&str> = result
        .body
        .variants
        .iter()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(names, VARIANTS);
    for v in &result.body.variants {
        assert_eq!(v.samples.len(), 1, "{}", v.name);
        let s = &v.samples[0].sample;
        assert_eq!(
            s.resident, s.populated,
            "{}: every populated byte resident",
            v.name
        );
        assert!(s.huge <= s.huge_span, "{}", v.name);
    }
    let sample = |i: usize| &result.body.variants[i].samples[0].sample;
    for i in [0, 1] {
        assert_eq!(sample(i).host_offset_in_thp, 0, "guestmem is congruent");
        assert_eq!(sample(i).huge_span, TINY_BYTES);
    }
    assert_eq!(
        sample(2).populated,
        TINY_BYTES - 4096,
        "tcg-style guard inside"
    );
    assert_eq!(sample(3).host_offset_in_thp, 4096);
    assert_eq!(sample(3).huge_span, TINY_BYTES - THP_BYTES);
    if thp_enabled() {
        for i in [0, 1] {
            assert_eq!(sample(i).huge, TINY_BYTES, "{}: 100% huge", VARIANTS[i]);
        }
        // The 2 MiB holding the guard page cannot be one huge page.
        assert!(sample(2).huge <= TINY_BYTES - THP_BYTES);
        assert!(sample(3).huge <= TINY_BYTES - THP_BYTES);
    }
}

#[test]
fn guards_too_small_region_is_refused() {
    let _serial = guestmem_testkit::host_lock();
    let cfg = GuardsLabConfig {
        size: MIN_REGION_BYTES - THP_BYTES,
        ..tiny()
    };
    assert!(run_guards(&cfg).is_err());
}

#[test]
fn guards_tiny_writes_json_and_markdown_run_folder() {
    let _serial = guestmem_testkit::host_lock();
    let result = run_guards(&tiny()).expect("scenario runs");
    let base = std::env::temp_dir().join(format!("guestmem-lab-guards-{}", std::process::id()));

    let dir = write_run(&result, &base).expect("run folder written");

    assert!(dir.to_string_lossy().ends_with("-guards"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("result.json")).unwrap()).unwrap();
    assert_eq!(json["scenario"], "guards");
    assert_eq!(json["seeds"], serde_json::json!(["003"]));
    for key in ["command", "git_commit", "kernel", "cpu_model", "cpus"] {
        assert!(json["run"].get(key).is_some(), "run.{key}");
    }
    assert_eq!(json["settings"]["size"], TINY_BYTES);
    let v = &json["variants"][2];
    for key in ["seconds", "huge", "coverage_of_region", "coverage_of_span"] {
        assert!(v.get(key).is_some(), "variant.{key}");
    }
    assert!(v["samples"][0].get("round").is_some(), "position flattened");
    let svg = std::fs::read_to_string(dir.join("plot.svg")).expect("plot written");
    assert!(svg.starts_with("<svg"));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert_eq!(md, result.markdown());
    for name in VARIANTS {
        assert!(md.contains(&format!("| {name} |")), "{name} row");
    }
    std::fs::remove_dir_all(&base).unwrap();
}
