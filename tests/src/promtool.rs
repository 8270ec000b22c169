//! `promtool check metrics` over what vgpu's components serve, with the one lint finding
//! vgpu accepts (ADR 0020): DCGM exporter's camelCase label names (`modelName`), which
//! operators' dashboards query by that name.

use std::io::Write;
use std::process::{Command, Stdio};

/// promtool's lint finding for DCGM's camelCase label names.
const DCGM_LABEL_LINT: &str = "label names should be written in 'snake_case' not 'camelCase'";

/// Runs `promtool check metrics` over the text exposition `text`; returns what it said
/// that is a problem (empty: none), or the error when promtool cannot be started.
pub fn check_metrics(text: &str) -> std::io::Result<Vec<String>> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("promtool's stdin is not piped"))?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(problems(out.status.code(), &said))
}

/// What promtool said that is a problem: exit 1 (a parse error) or any lint finding but
/// [`DCGM_LABEL_LINT`] (exit 3 is lint findings only).
fn problems(code: Option<i32>, said: &str) -> Vec<String> {
    let mut out: Vec<String> = said
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_end().ends_with(DCGM_LABEL_LINT))
        .map(str::to_owned)
        .collect();
    if !matches!(code, Some(0 | 3)) {
        out.push(format!("exit status {code:?}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_dcgm_label_finding_is_accepted() {
        let dcgm = format!("vgpu_gpu_info {DCGM_LABEL_LINT}\n");
        assert!(problems(Some(3), &dcgm).is_empty());
        assert!(problems(Some(0), "").is_empty());
        assert_eq!(
            problems(Some(3), "x counter metrics should have \"_total\" suffix\n").len(),
            1
        );
        assert_eq!(
            problems(Some(1), "error while linting: text format parsing error").len(),
            2
        );
        assert_eq!(problems(None, "").len(), 1, "killed by a signal");
    }
}
