//! The documentation holds together. Every relative link in README.md, CHANGELOG.md, the files
//! of `docs/` and the Python client's README names a file that exists, and every `#anchor`
//! names a heading of its target under GitHub's slug rules (lowercase, spaces to `-`,
//! punctuation other than `-` and `_` dropped, repeated headings suffixed `-1`, `-2`, ...).
//! README.md stays a front door and every `docs/` page a reference of one subject (see
//! [`BUDGETS`]), and the documentation describes what is true now: never tracker issue numbers,
//! commit hashes (history belongs in CHANGELOG.md and commit messages) or a chronicle of
//! machines and runs ("the seventh machine"). A broken sample in a temporary directory proves
//! the checker fails when a link or an anchor does not resolve.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// The documents the checks cover: README.md, CHANGELOG.md, the Python client's README and
/// every `docs/*.md`.
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![
        root.join("README.md"),
        root.join("CHANGELOG.md"),
        root.join("clients/python/README.md"),
    ];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// The lines outside fenced code blocks, numbered from 1.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    // The open fence's character and length, while inside a fenced block.
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |c| trimmed.chars().take_while(|x| *x == c).count());
        match (fence, marker) {
            (None, Some(c)) if run >= 3 => fence = Some((c, run)),
            (Some((c, n)), Some(m)) if m == c && run >= n && trimmed.trim_end().len() == run => {
                fence = None
            }
            (None, _) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` with every inline code span replaced by `x`, so that code such as `` `[a](b)` `` is
/// not read as a link. An unmatched backtick run stays as written.
fn without_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|c| **c == '`').count();
        // The closing run: exactly n backticks.
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            if chars[j] == '`' {
                let m = chars[j..].iter().take_while(|c| **c == '`').count();
                if m == n {
                    close = Some(j);
                    break;
                }
                j += m;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                out.push('x');
                i = j + n;
            }
            None => {
                out.extend(&chars[i..i + n]);
                i += n;
            }
        }
    }
    out
}

/// The targets of the inline links and images (`[text](target)`, `![alt](target "title")`) on
/// one line of prose.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut out = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let inside = after[..end].trim();
        let target = inside
            .strip_prefix('<')
            .and_then(|t| t.split_once('>').map(|(t, _)| t))
            .unwrap_or_else(|| inside.split_whitespace().next().unwrap_or(""));
        out.push(target.to_string());
        rest = &after[end.min(after.len())..];
    }
    out
}

/// GitHub's anchor for a heading's text: lowercase, spaces to `-`, every other character that
/// is not a letter, a digit, `-` or `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

/// The anchors of a Markdown document's headings, in GitHub's form: a slug that appeared
/// before gets `-1`, `-2`, ... in order.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if hashes == 0 || hashes > 6 {
            continue;
        }
        let rest = &line[hashes..];
        if !(rest.is_empty() || rest.starts_with(' ') || rest.starts_with('\t')) {
            continue;
        }
        let title = rest.trim().trim_end_matches('#').trim_end();
        let base = slug(title);
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// Every relative link of `doc` that does not resolve, as `file:line: target (reason)`.
fn broken_links(doc: &Path, root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(doc).unwrap_or_else(|e| panic!("read {doc:?}: {e}"));
    let name = doc.strip_prefix(root).unwrap_or(doc).display().to_string();
    let mut anchor_cache: HashMap<PathBuf, Vec<String>> = HashMap::new();
    let mut out = Vec::new();
    for (number, line) in prose_lines(&text) {
        for target in link_targets(line) {
            // Absolute URLs (https:, mailto:, ...) are not this test's business.
            let scheme_end = target.find([':', '/', '#']);
            if target.is_empty() || scheme_end.is_some_and(|i| target[i..].starts_with(':')) {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let file = if path.is_empty() {
                doc.to_path_buf()
            } else {
                doc.parent().expect("a document's directory").join(path)
            };
            if !file.exists() {
                out.push(format!("{name}:{number}: {target} (no such file)"));
                continue;
            }
            let Some(anchor) = anchor.filter(|a| !a.is_empty()) else {
                continue;
            };
            if file.extension().is_none_or(|e| e != "md") {
                continue;
            }
            let known = anchor_cache.entry(file.clone()).or_insert_with(|| {
                anchors(&std::fs::read_to_string(&file).expect("read link target"))
            });
            if !known.iter().any(|a| a == anchor) {
                out.push(format!("{name}:{number}: {target} (no such heading)"));
            }
        }
    }
    out
}

/// Mentions of a tracker issue by number ("issue 11", "Issues 8", "issue-8", "issue #12"), as
/// excerpts.
fn issue_numbers(text: &str) -> Vec<String> {
    let lower: Vec<char> = text.to_lowercase().chars().collect();
    let word: Vec<char> = "issue".chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i + word.len() <= lower.len() {
        let starts_word = i == 0 || !lower[i - 1].is_alphanumeric();
        if starts_word && lower[i..i + word.len()] == word[..] {
            let mut j = i + word.len();
            if lower.get(j) == Some(&'s') {
                j += 1;
            }
            while lower
                .get(j)
                .is_some_and(|c| matches!(c, ' ' | '\t' | '\n' | '-' | '#'))
            {
                j += 1;
            }
            if lower.get(j).is_some_and(|c| c.is_ascii_digit()) {
                let from = i.saturating_sub(30);
                let to = (j + 10).min(lower.len());
                let excerpt: String = lower[from..to].iter().collect();
                out.push(excerpt.replace('\n', " "));
            }
        }
        i += 1;
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = repo();
    let broken: Vec<String> = documents(&root)
        .iter()
        .flat_map(|doc| broken_links(doc, &root))
        .collect();
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Line budgets: the README is a front door (what, why, one command to run, one to test, where
/// to read on); a `docs/` page is the reference of one subject, and past 700 lines it is either
/// two subjects or a chronicle. Both limits are about twice what a reader takes in one sitting,
/// and every page is under them today by a margin for growth.
const BUDGETS: [(&str, usize); 2] = [("README.md", 350), ("docs/*.md", 700)];

/// README.md and every `docs/*.md`: the pages that speak of what is true now (CHANGELOG.md is
/// the history).
fn reference_pages(root: &Path) -> Vec<PathBuf> {
    documents(root)
        .into_iter()
        .filter(|p| !p.ends_with("CHANGELOG.md") && !p.ends_with("clients/python/README.md"))
        .collect()
}

/// Pages over their line budget, as `path: N lines (budget M)`.
fn over_budget(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for page in reference_pages(root) {
        let rel = page.strip_prefix(root).unwrap_or(&page);
        let budget = if rel == Path::new("README.md") {
            BUDGETS[0].1
        } else {
            BUDGETS[1].1
        };
        let lines = std::fs::read_to_string(&page)
            .expect("read page")
            .lines()
            .count();
        if lines > budget {
            out.push(format!(
                "{}: {lines} lines (budget {budget})",
                rel.display()
            ));
        }
    }
    out
}

#[test]
fn every_page_stays_within_its_line_budget() {
    let over = over_budget(&repo());
    assert!(
        over.is_empty(),
        "pages over budget (move reference material into a page of its own, history into \
         CHANGELOG.md):\n{}",
        over.join("\n")
    );
}

/// Runs of 7 to 40 hexadecimal characters standing alone (not inside a longer word), with
/// their line numbers: the candidates for commit hashes.
fn hex_words(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for word in line.split(|c: char| !c.is_ascii_alphanumeric()) {
            if (7..=40).contains(&word.len())
                && word.chars().all(|c| c.is_ascii_hexdigit())
                && word.chars().any(|c| c.is_ascii_alphabetic())
                && word.chars().any(|c| c.is_ascii_digit())
            {
                out.push((n + 1, word.to_ascii_lowercase()));
            }
        }
    }
    out
}

/// The words of `candidates` that name an object of the repository at `root` (`git cat-file
/// --batch-check`: an abbreviated hash resolves too, an ambiguous one counts as resolving).
fn resolving_objects(root: &Path, candidates: &[String]) -> Vec<String> {
    use std::io::Write as _;
    if candidates.is_empty() {
        return Vec::new();
    }
    let mut child = std::process::Command::new("git")
        .args(["cat-file", "--batch-check"])
        .current_dir(root)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("git cat-file");
    let mut input = child.stdin.take().expect("stdin");
    let words = candidates.join("\n") + "\n";
    let writer = std::thread::spawn(move || input.write_all(words.as_bytes()));
    let out = child.wait_with_output().expect("git cat-file output");
    writer.join().expect("writer").expect("write to git");
    assert!(out.status.success(), "git cat-file --batch-check failed");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .zip(candidates)
        .filter(|(answer, _)| !answer.ends_with(" missing"))
        .map(|(_, word)| word.clone())
        .collect()
}

/// Commit hashes (or any git object) named in `text`, as `line: hash`.
fn commit_hashes(root: &Path, text: &str) -> Vec<String> {
    let words = hex_words(text);
    let plain: Vec<String> = words.iter().map(|(_, w)| w.clone()).collect();
    let found = resolving_objects(root, &plain);
    words
        .into_iter()
        .filter(|(_, w)| found.contains(w))
        .map(|(n, w)| format!("{n}: {w}"))
        .collect()
}

#[test]
fn the_documentation_names_no_commits() {
    let root = repo();
    let mut found = Vec::new();
    for page in reference_pages(&root) {
        let text = std::fs::read_to_string(&page).expect("read page");
        for hit in commit_hashes(&root, &text) {
            found.push(format!("{}:{hit}", page.display()));
        }
    }
    assert!(
        found.is_empty(),
        "commit hashes (history goes in CHANGELOG.md and commit messages):\n{}",
        found.join("\n")
    );
}

/// Ordinal words, and whether a run or a session counted by them reads as a chronicle: "the
/// first run" and "a second run" are ordinary prose, "the seventh run" is a log.
const ORDINALS: [&str; 20] = [
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
    "thirteenth",
    "fourteenth",
    "fifteenth",
    "sixteenth",
    "seventeenth",
    "eighteenth",
    "nineteenth",
    "twentieth",
];

/// Whether `word` is an ordinal, and its rank (`7th` is 7).
fn ordinal(word: &str) -> Option<usize> {
    if let Some(i) = ORDINALS.iter().position(|o| *o == word) {
        return Some(i + 1);
    }
    let digits: String = word.chars().take_while(char::is_ascii_digit).collect();
    let suffix = &word[digits.len()..];
    (!digits.is_empty() && matches!(suffix, "st" | "nd" | "rd" | "th"))
        .then(|| digits.parse().ok())
        .flatten()
}

/// A chronicle of machines or runs: an ordinal followed within two words by "machine" (any
/// rank), or by "run", "session" or "round" (from the third on), as `line: words`.
fn chronicle(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        let words: Vec<&str> = lower
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|w| !w.is_empty())
            .collect();
        for (i, w) in words.iter().enumerate() {
            let Some(rank) = ordinal(w) else { continue };
            for (k, next) in words.iter().enumerate().skip(i + 1).take(3) {
                let noun = next.trim_end_matches('s');
                if noun == "machine" || (rank >= 3 && matches!(noun, "run" | "session" | "round")) {
                    out.push(format!("{}: {}", n + 1, words[i..=k].join(" ")));
                    break;
                }
            }
        }
    }
    out
}

#[test]
fn the_documentation_keeps_no_chronicle_of_machines_or_runs() {
    let root = repo();
    let mut found = Vec::new();
    for page in reference_pages(&root) {
        let text = std::fs::read_to_string(&page).expect("read page");
        for hit in chronicle(&text) {
            found.push(format!("{}:{hit}", page.display()));
        }
    }
    assert!(
        found.is_empty(),
        "a chronicle of machines or runs (state the current figures; history goes in \
         CHANGELOG.md):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_history_checks_tell_history_from_prose() {
    assert_eq!(
        chronicle(
            "On the seventh fresh machine, and on an 8th machine.\nThe eleventh run.\n\
             A second run is safe; the first run builds; the first machine you try.\n\
             The third session's drains.\nA second-hand machine. Seventh heaven."
        ),
        [
            "1: seventh fresh machine",
            "1: 8th machine",
            "2: eleventh run",
            "3: first machine",
            "4: third session",
            "5: second hand machine",
        ]
    );
    let hexes: Vec<String> =
        hex_words("see 74232e2, 0x1f, deadbeef, 20261201, a3f9c2d1e\n`abc1234`")
            .into_iter()
            .map(|(n, w)| format!("{n}:{w}"))
            .collect();
    assert_eq!(hexes, ["1:74232e2", "1:a3f9c2d1e", "2:abc1234"]);
    // The repository's first commit resolves; a hex word that names no object does not.
    let root = repo();
    let first = std::process::Command::new("git")
        .args(["rev-list", "--max-parents=0", "HEAD"])
        .current_dir(&root)
        .output()
        .expect("git rev-list");
    let first = String::from_utf8_lossy(&first.stdout)
        .lines()
        .next()
        .expect("a first commit")[..9]
        .to_string();
    let text = format!("landed in {first}; an example id 0000000a0b0c0d");
    assert_eq!(commit_hashes(&root, &text), [format!("1: {first}")]);
}

#[test]
fn the_documentation_names_no_issue_numbers() {
    let root = repo();
    let mut found = Vec::new();
    for doc in documents(&root) {
        let text = std::fs::read_to_string(&doc).expect("read document");
        for excerpt in issue_numbers(&text) {
            found.push(format!("{}: …{excerpt}…", doc.display()));
        }
    }
    assert!(found.is_empty(), "issue numbers:\n{}", found.join("\n"));
}

/// Code, comments, scripts and configuration speak of rules, not of tracker issues: every file
/// git tracks, except this one (its samples must name some) and applied migrations (sqlx checks
/// their checksums, so their text is history that cannot change).
#[test]
fn the_code_names_no_issue_numbers() {
    let root = repo();
    let listed = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(&root)
        .output()
        .expect("git ls-files");
    assert!(listed.status.success(), "git ls-files failed");
    let mut found = Vec::new();
    for name in String::from_utf8_lossy(&listed.stdout).split('\0') {
        let immutable = name.ends_with(".sql") && name.contains("migrations/");
        if name.is_empty()
            || name == "tests/tests/suites/docs.rs"
            || name.ends_with(".lock")
            || immutable
        {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root.join(name)) else {
            continue; // binary or removed in the work tree
        };
        for excerpt in issue_numbers(&text) {
            found.push(format!("{name}: …{excerpt}…"));
        }
    }
    assert!(found.is_empty(), "issue numbers:\n{}", found.join("\n"));
}

#[test]
fn github_slugs_and_the_issue_scan() {
    assert_eq!(
        slug("Worker (`worker` binary, including `worker ops`)"),
        "worker-worker-binary-including-worker-ops"
    );
    assert_eq!(
        slug("Metrics (`GET /metrics` on `METRICS_ADDR`)"),
        "metrics-get-metrics-on-metrics_addr"
    );
    assert_eq!(slug("11. Where code lives"), "11-where-code-lives");
    assert_eq!(
        anchors("# A\n## Same\n```\n## Not a heading\n```\n## Same\n### Same\n#hashtag\n"),
        ["a", "same", "same-1", "same-2"]
    );
    assert_eq!(
        link_targets("see [a](x.md#b) and `[c](code.md)` and ![d](img.png \"title\")"),
        ["x.md#b", "img.png"]
    );
    let hits = issue_numbers(
        "Landed in issue 11; Issues\n8 and issue-9, issue #12. Not: tissue 5, issues/4335, an issue.",
    );
    assert_eq!(hits.len(), 4, "{hits:?}");
}

#[test]
fn the_checker_fails_on_a_broken_sample() {
    let dir = std::env::temp_dir().join(format!("docs-check-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    std::fs::write(
        dir.join("README.md"),
        "# Intro\n\n\
         [fine](docs/a.md#second-heading-1), [fine too](#intro), [web](https://example.com/x#y),\n\
         [missing file](docs/nope.md), [missing heading](docs/a.md#nope),\n\
         [missing here](#outro), `[code, not a link](nowhere.md)`\n\n\
         ```\n[in a fence, not a link](nowhere-either.md)\n```\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("docs/a.md"),
        "# A\n\n## Second heading\n\n## Second heading\n",
    )
    .unwrap();
    let broken = broken_links(&dir.join("README.md"), &dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        broken,
        [
            "README.md:4: docs/nope.md (no such file)",
            "README.md:4: docs/a.md#nope (no such heading)",
            "README.md:5: #outro (no such heading)",
        ],
        "{broken:#?}"
    );
}
