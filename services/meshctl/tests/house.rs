//! House rules that a reader relies on, checked on the sources:
//! - imports only go down: within each crate, the top-level modules that
//!   name each other (`crate::x`, outside comments, tests included) form no
//!   circle;
//! - the router builds no gRPC status outside its error table
//!   (`services/router/src/error.rs`): elsewhere only `Status::from(Error)`.
// Tests unwrap: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Every crate's `src` folder: kernels/, kernels/cuda/, loadtest/, proto/
/// and services/*.
fn crate_sources() -> Vec<PathBuf> {
    let root = repo();
    let mut out: Vec<PathBuf> =
        ["kernels", "kernels/cuda", "loadtest", "proto"].iter().map(|c| root.join(c).join("src")).collect();
    for e in std::fs::read_dir(root.join("services")).unwrap().flatten() {
        if e.path().join("src").is_dir() {
            out.push(e.path().join("src"));
        }
    }
    out.retain(|p| p.is_dir());
    out.sort();
    out
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out
}

/// The source without `//` comments (doc links name modules above too).
fn code_only(text: &str) -> String {
    text.lines().map(|l| l.split_once("//").map_or(l, |(code, _)| code)).collect::<Vec<_>>().join("\n")
}

/// Module names a piece of code reaches through `crate::`: `crate::x::...`
/// and `use crate::{x, y::z}`.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(group.split(',').map(|p| ident(p.trim())).filter(|s| !s.is_empty()));
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

/// Each top-level module of the crate in `src` -> the top-level modules it names.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let top = |p: &Path| -> Option<String> {
        let first = p.strip_prefix(src).ok()?.components().next()?.as_os_str().to_str()?.to_string();
        let name = first.strip_suffix(".rs").unwrap_or(&first).to_string();
        (!["lib", "main", "bin"].contains(&name.as_str())).then_some(name)
    };
    let files = rust_files(src);
    let modules: BTreeSet<String> = files.iter().filter_map(|f| top(f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for f in &files {
        let Some(from) = top(f) else { continue };
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        for to in crate_paths(&code) {
            if to != from && modules.contains(&to) {
                graph.get_mut(&from).unwrap().insert(to);
            }
        }
    }
    graph
}

/// A circle in `graph`, as the modules along it, if there is one.
fn find_circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        at: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|m| m == at) {
            let mut circle = path[i..].to_vec();
            circle.push(at.to_string());
            return Some(circle);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in g.get(at).into_iter().flatten() {
            if let Some(c) = visit(g, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut circles = Vec::new();
    let sources = crate_sources();
    assert!(sources.len() >= 19, "found only {} crates: {sources:?}", sources.len());
    for src in &sources {
        if let Some(c) = find_circle(&module_graph(src)) {
            circles.push(format!("{}: {}", src.strip_prefix(repo()).unwrap().display(), c.join(" -> ")));
        }
    }
    assert!(circles.is_empty(), "modules that import each other:\n{}", circles.join("\n"));
}

#[test]
fn the_circle_finder_finds_circles_and_only_circles() {
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(find_circle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(find_circle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])).map(|c| c.len()), Some(4));
    let code = code_only("use crate::{x, y::z};\n/// [`crate::w`]\nlet v = crate::q::f(); // crate::r");
    assert_eq!(crate_paths(&code).into_iter().collect::<Vec<_>>(), ["q", "x", "y"]);
}

#[test]
fn the_router_builds_statuses_only_in_its_error_table() {
    let src = repo().join("services/router/src");
    let mut inline = Vec::new();
    for f in rust_files(&src) {
        if f.ends_with("error.rs") {
            continue;
        }
        let code = code_only(&std::fs::read_to_string(&f).unwrap());
        for (n, line) in code.lines().enumerate() {
            let built = line.match_indices("Status::").any(|(i, _)| {
                let call = &line[i + "Status::".len()..];
                let name: String = call.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                call[name.len()..].starts_with('(') && name != "from"
            });
            if built {
                inline.push(format!("{}:{}: {}", f.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(inline.is_empty(), "gRPC statuses built outside error.rs:\n{}", inline.join("\n"));
}
