//! ARCHITECTURE.md is the one map of the code, and it must stay true: every source file of
//! every crate is named in its crate's section, and the library's module graph has no
//! cycle (between its top-level modules, and between the files of each module folder),
//! as the map says.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file under `dir`, as paths relative to it, sorted.
fn sources(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(dir).unwrap().to_string_lossy().into_owned();
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

/// The part of ARCHITECTURE.md about crate `name`: from its `### \`crates/NAME\`` heading to
/// the next heading of that level or above.
fn section<'a>(doc: &'a str, name: &str) -> &'a str {
    let head = format!("### `crates/{name}`");
    let start = doc
        .find(&head)
        .unwrap_or_else(|| panic!("ARCHITECTURE.md has no section {head}"));
    let rest = &doc[start + head.len()..];
    let end = [rest.find("\n### "), rest.find("\n## ")]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(rest.len());
    &rest[..end]
}

#[test]
fn every_source_file_is_named_in_its_crates_section_of_the_map() {
    let doc = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let mut missing = Vec::new();
    for e in std::fs::read_dir(root().join("crates")).unwrap() {
        let krate = e.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        let src = krate.join("src");
        if !src.is_dir() {
            continue;
        }
        let text = section(&doc, &name);
        for f in sources(&src) {
            // Named as its path in `src/`, in backticks (`serve/server.rs`), or a module
            // folder's `mod.rs` by the folder (`serve/`).
            let named = text.contains(&format!("`{f}`"))
                || f.strip_suffix("mod.rs")
                    .is_some_and(|dir| text.contains(&format!("`{dir}`")));
            if !named {
                missing.push(format!("crates/{name}/src/{f}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md does not name these files in their crate's section: {missing:#?}"
    );
}

/// `src` without its comments and its unit tests: what the code itself names.
fn code(src: &str) -> String {
    let src = src.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
    src.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers that follow `prefix` (`crate::`, `super::`) in `text`.
fn named_after<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.match_indices(prefix)
        .map(|(i, _)| {
            let rest = &text[i + prefix.len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// A cycle in `graph`, if there is one (depth-first search, three colours).
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        v: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(v.to_string(), 1);
        path.push(v.to_string());
        for w in graph.get(v).into_iter().flatten() {
            match state.get(w.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = path.iter().position(|p| p == w).unwrap();
                    let mut c = path[at..].to_vec();
                    c.push(w.clone());
                    return Some(c);
                }
                0 => {
                    if let Some(c) = visit(w, graph, state, path) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        path.pop();
        state.insert(v.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for v in graph.keys() {
        if state.get(v.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(v, graph, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The modules of folder `dir` (its files and subfolders, `mod.rs` and the crate root left
/// out), each with the files that make it up.
fn modules_of(dir: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            let files = sources(&p).into_iter().map(|f| p.join(f)).collect();
            out.insert(name, files);
        } else if p.extension().is_some_and(|x| x == "rs") && name != "mod" && name != "lib" {
            out.insert(name, vec![p]);
        }
    }
    out
}

/// The uses among the modules of `dir` that the code names through `prefix` (`crate::` for
/// the crate's top level, `super::` for a module folder's files). Names the crate root
/// re-exports (`crate::HugePageSize`) count as uses of the module they come from.
fn graph(
    dir: &Path,
    prefix: &str,
    reexports: &BTreeMap<String, String>,
) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules_of(dir);
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, files) in &mods {
        let uses = g.entry(m.clone()).or_default();
        for f in files {
            let text = code(&std::fs::read_to_string(f).unwrap());
            for n in named_after(&text, prefix) {
                let target = if mods.contains_key(n) {
                    Some(n.to_string())
                } else {
                    reexports.get(n).cloned()
                };
                if let Some(t) = target.filter(|t| t != m) {
                    uses.insert(t);
                }
            }
        }
    }
    g
}

/// The names the crate root re-exports, each with the module it comes from.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let text = code(lib);
    for stmt in text.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        for n in names
            .trim_matches(|c| c == '{' || c == '}')
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|n| !n.is_empty())
        {
            out.insert(
                n.trim_matches(|c| c == '{' || c == '}').to_string(),
                module.to_string(),
            );
        }
    }
    out
}

#[test]
fn the_librarys_module_graph_has_no_cycle() {
    let src = root().join("crates/guestmem/src");
    let reexports = root_reexports(&std::fs::read_to_string(src.join("lib.rs")).unwrap());
    let top = graph(&src, "crate::", &reexports);
    assert!(top.len() > 10, "found the modules: {top:?}");
    if let Some(c) = cycle(&top) {
        panic!("the library's top-level modules use each other in a cycle: {c:?}");
    }
    // Each module folder's files, and its subfolders', among themselves.
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                let g = graph(&p, "super::", &BTreeMap::new());
                if let Some(c) = cycle(&g) {
                    panic!(
                        "the files of {} use each other in a cycle: {c:?}",
                        p.display()
                    );
                }
                dirs.push(p);
            }
        }
    }
}
