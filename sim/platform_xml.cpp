// The platform of build_platform as SimGrid XML (platform_4_1.dtd), for other SimGrid tools.
#include <fmt/format.h>

#include "sim/platform.hpp"

namespace pw::sim {

namespace {

// Shortest text that reads back as the same double, so the file gives the same times.
std::string num(double v) {
  return fmt::format("{}", v);
}

void write_link(std::string& out, const LinkSpec& s, const char* indent, const char* policy) {
  out += fmt::format(R"({}<link id="{}" bandwidth="{}Bps" latency="{}s" sharing_policy="{}"/>)",
                     indent, s.name, num(s.bandwidth_bytes_per_s), num(s.latency_s), policy);
  out += "\n";
}

void write_node(std::string& out, const NodeModel& m) {
  out += fmt::format("    <zone id=\"{}\" routing=\"Full\">\n", m.zone);
  for (const std::string& g : m.gpus)
    out += fmt::format("      <host id=\"{}\" speed=\"{}f\"/>\n", g, num(kGpuSpeed));
  out += fmt::format("      <host id=\"{}\" speed=\"{}f\"/>\n", m.cpu, num(kCpuSpeed));
  out += fmt::format("      <router id=\"{}\"/>\n", m.router);
  for (const LinkSpec& s : m.links)
    write_link(out, s, "      ", s.split_duplex ? "SPLITDUPLEX" : "SHARED");
  for (const LocalRoute& r : m.routes) {
    out += fmt::format("      <route src=\"{}\" dst=\"{}\" symmetrical=\"NO\">", r.src, r.dst);
    for (const LinkUse& u : r.links) {
      const std::string& id = m.links[u.link].name;
      if (u.dir == Dir::none)
        out += fmt::format("<link_ctn id=\"{}\"/>", id);
      else
        out += fmt::format("<link_ctn id=\"{}\" direction=\"{}\"/>", id,
                           u.dir == Dir::up ? "UP" : "DOWN");
    }
    out += "</route>\n";
  }
  out += "    </zone>\n";
}

}  // namespace

std::string platform_xml(const clusters::Cluster& c, const PlatformOptions& options) {
  std::string out =
      "<?xml version='1.0'?>\n"
      "<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
      "<platform version=\"4.1\">\n";
  out += fmt::format("  <!-- pipewright: cluster {}, {} nodes x {} GPUs -->\n", c.name, c.nodes,
                     c.gpus_per_node);
  out += "  <config>\n";
  for (const char* kv :
       {"network/model:CM02", "network/crosstraffic:0", "network/TCP-gamma:0", "network/weight-S:0",
        "network/latency-factor:1", "network/bandwidth-factor:1"}) {
    const std::string s = kv;
    const auto colon = s.find(':');
    out += fmt::format("    <prop id=\"{}\" value=\"{}\"/>\n", s.substr(0, colon),
                       s.substr(colon + 1));
  }
  out += "  </config>\n";
  out += "  <zone id=\"pipewright\" routing=\"Full\">\n";
  for (int n = 0; n < c.nodes; ++n)
    write_node(out, node_model(c, n, options));
  // XML has no star zone: a route per pair of nodes, over the backbone or a free fat pipe.
  const bool backbone = has_backbone(c, options);
  const LinkSpec middle =
      backbone ? backbone_spec(c) : LinkSpec{"switch", "network", 1e18, 0.0, false};
  if (c.nodes > 1) write_link(out, middle, "    ", backbone ? "SHARED" : "FATPIPE");
  for (int a = 0; a < c.nodes; ++a)
    for (int b = a + 1; b < c.nodes; ++b)
      out += fmt::format(
          "    <zoneRoute src=\"n{0}\" dst=\"n{1}\" gw_src=\"n{0}-router\" "
          "gw_dst=\"n{1}-router\"><link_ctn id=\"{2}\"/></zoneRoute>\n",
          a, b, middle.name);
  out += "  </zone>\n</platform>\n";
  return out;
}

}  // namespace pw::sim
