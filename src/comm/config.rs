//! `ncclConfig_t` as callers built against any NCCL header since 2.14 pass it: read `size` bytes
//! at most, check the magic, and treat fields newer than the caller's `version` as unset.

use crate::error::Result;

pub(crate) const UNDEF_INT: i32 = i32::MIN;

/// The settings this library acts on, after defaults and environment overrides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    pub blocking: bool,
    pub comm_name: Option<String>,
    pub split_share: bool,
    pub shrink_share: bool,
    /// The raw fields, kept so that split/shrink children inherit exactly what the parent got.
    pub raw: RawConfig,
}

/// Every 2.30 field as an int (pointer fields as owned strings), UNDEF_INT where unset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RawConfig {
    pub blocking: i32,
    pub cga_cluster_size: i32,
    pub min_ctas: i32,
    pub max_ctas: i32,
    pub net_name: Option<String>,
    pub split_share: i32,
    pub traffic_class: i32,
    pub comm_name: Option<String>,
    pub collnet_enable: i32,
    pub cta_policy: i32,
    pub shrink_share: i32,
    pub nvls_ctas: i32,
    pub n_channels_per_net_peer: i32,
    pub nvlink_centric_sched: i32,
    pub graph_usage_mode: i32,
    pub num_rma_ctx: i32,
    pub max_p2p_peers: i32,
    pub graph_stream_ordering: i32,
}

impl Default for RawConfig {
    fn default() -> RawConfig {
        RawConfig {
            blocking: UNDEF_INT,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: UNDEF_INT,
            net_name: None,
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
            comm_name: None,
            collnet_enable: UNDEF_INT,
            cta_policy: UNDEF_INT,
            shrink_share: UNDEF_INT,
            nvls_ctas: UNDEF_INT,
            n_channels_per_net_peer: UNDEF_INT,
            nvlink_centric_sched: UNDEF_INT,
            graph_usage_mode: UNDEF_INT,
            num_rma_ctx: UNDEF_INT,
            max_p2p_peers: UNDEF_INT,
            graph_stream_ordering: UNDEF_INT,
        }
    }
}

pub(crate) const fn version(x: u32, y: u32, z: u32) -> u32 {
    if x <= 2 && y <= 8 {
        x * 1000 + y * 100 + z
    } else {
        x * 10000 + y * 100 + z
    }
}

fn bool_field(name: &str, v: i32) -> Result<Option<bool>> {
    match v {
        UNDEF_INT => Ok(None),
        0 => Ok(Some(false)),
        1 => Ok(Some(true)),
        _ => crate::invalid_arg!("config->{name} is {v}; it must be 0 or 1"),
    }
}

impl Config {
    /// Applies defaults and environment overrides (`COMM_COMM_BLOCKING` / `NCCL_COMM_BLOCKING`
    /// like NCCL) to what the caller set.
    pub(crate) fn resolve(raw: RawConfig) -> Result<Config> {
        let blocking = match bool_field("blocking", raw.blocking)? {
            Some(b) => b,
            None => crate::env::COMM_BLOCKING.flag(),
        };
        if raw.cta_policy != UNDEF_INT && !(0..=2).contains(&raw.cta_policy) {
            return crate::invalid_arg!(
                "config->CTAPolicy is {}; it must be NCCL_CTA_POLICY_DEFAULT, _EFFICIENCY or _ZERO",
                raw.cta_policy
            );
        }
        for (name, v) in [
            ("minCTAs", raw.min_ctas),
            ("maxCTAs", raw.max_ctas),
            ("cgaClusterSize", raw.cga_cluster_size),
            ("nvlsCTAs", raw.nvls_ctas),
        ] {
            if v != UNDEF_INT && v < 0 {
                return crate::invalid_arg!("config->{name} is {v}; it must not be negative");
            }
        }
        if raw.min_ctas != UNDEF_INT && raw.max_ctas != UNDEF_INT && raw.min_ctas > raw.max_ctas {
            return crate::invalid_arg!(
                "config->minCTAs ({}) is larger than config->maxCTAs ({})",
                raw.min_ctas,
                raw.max_ctas
            );
        }
        Ok(Config {
            blocking,
            comm_name: raw.comm_name.clone(),
            split_share: bool_field("splitShare", raw.split_share)?.unwrap_or(false),
            shrink_share: bool_field("shrinkShare", raw.shrink_share)?.unwrap_or(false),
            raw,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_blocking() {
        assert!(Config::resolve(RawConfig::default()).unwrap().blocking);
    }

    #[test]
    fn out_of_range_values_name_the_field() {
        let raw = RawConfig {
            blocking: 5,
            ..RawConfig::default()
        };
        let e = Config::resolve(raw).unwrap_err();
        assert!(e.msg.contains("config->blocking"), "{}", e.msg);
        let raw = RawConfig {
            min_ctas: 8,
            max_ctas: 4,
            ..RawConfig::default()
        };
        assert!(Config::resolve(raw).unwrap_err().msg.contains("minCTAs"));
    }

    #[test]
    fn version_codes_follow_both_regimes() {
        assert_eq!(version(2, 8, 4), 2804);
        assert_eq!(version(2, 30, 7), 23007);
    }
}
