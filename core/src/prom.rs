//! The Prometheus text exposition format (0.0.4), written by hand: metric families with
//! HELP, TYPE and escaped labels. Used by the node daemon and the device plugin.

use std::collections::HashSet;
use std::fmt::Write as _;

/// The exposition format's content type.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Prometheus metric kinds used here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A value that goes up and down.
    Gauge,
    /// A value that only goes up (resets when its series restarts).
    Counter,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// One metric family: HELP, TYPE and its samples, at most one per label set.
#[derive(Debug)]
pub struct Family {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    samples: Vec<(String, f64)>,
    seen: HashSet<String>,
}

impl Family {
    /// An empty family.
    pub fn new(name: &'static str, kind: Kind, help: &'static str) -> Family {
        Family {
            name,
            help,
            kind,
            samples: Vec::new(),
            seen: HashSet::new(),
        }
    }

    /// Adds a sample; a second sample with the same labels is dropped (the exposition
    /// format allows one per label set).
    pub fn sample(&mut self, labels: &[(&str, &str)], value: f64) {
        let l = render_labels(labels);
        if self.seen.insert(l.clone()) {
            self.samples.push((l, value));
        }
    }

    /// Appends the family in the text format.
    pub fn write(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, escape_help(self.help));
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind.as_str());
        for (labels, v) in &self.samples {
            let _ = writeln!(out, "{}{} {}", self.name, labels, format_value(*v));
        }
    }
}

/// `{a="x",b="y"}` with the values escaped (`\\`, `\"`, `\n`); empty for no labels.
pub fn render_labels(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let mut s = String::from("{");
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(k);
        s.push_str("=\"");
        s.push_str(&escape_label_value(v));
        s.push('"');
    }
    s.push('}');
    s
}

/// Escapes a label value: backslash, double quote and line feed.
pub fn escape_label_value(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Escapes HELP text: backslash and line feed.
pub fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// A sample value as the format spells it (`NaN`, `+Inf`, `-Inf`, else a decimal).
pub fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}
