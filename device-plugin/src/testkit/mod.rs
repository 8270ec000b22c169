//! Test doubles of the plugin's peers, used by the tests and by `vgpu-device-plugin bench`:
//! a fake kubelet that speaks the real gRPC protocols over unix sockets (Registration
//! server, DevicePlugin client, PodResources server, with kubelet's admission order and
//! device reuse) and a scripted fake API server (pods: get, list, watch). Every wait has
//! a deadline, so a call that never comes fails fast instead of hanging.

pub mod fake_api;
pub mod fake_kubelet;
pub mod node;
