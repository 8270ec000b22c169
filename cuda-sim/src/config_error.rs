//! Why a simulated node's configuration (or its topology file) could not be used: one
//! error type for the configuration and the modules it is built from.

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read simulator config {path}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown keys.
    #[error("invalid simulator config {path}")]
    Toml {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: toml::de::Error,
    },
    /// A value is out of range or malformed.
    #[error("invalid simulator config {path}: {field} = {value:?}: {why}")]
    Value {
        /// The file.
        path: String,
        /// The key, with the device index where it applies.
        field: String,
        /// The offending value.
        value: String,
        /// What is wrong with it.
        why: String,
    },
}
