#include "sim_plot.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace keel::cli {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

double seconds(Duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

bool plot_format_supported(const std::string& path) {
  return ends_with(path, ".svg") || ends_with(path, ".png");
}

std::string plot_data(const std::vector<sim::Report>& reports) {
  std::ostringstream d;
  d.setf(std::ios::fixed);
  d.precision(6);
  for (const auto& r : reports) {
    const double w = seconds(r.slice);
    d << "# " << r.policy << ": time (s), attempts/s, retries/s\n";
    for (std::size_t i = 0; i < r.slices.size(); ++i) {
      d << w * (static_cast<double>(i) + 0.5) << ' ' << static_cast<double>(r.slices[i].offered) / w
        << ' ' << static_cast<double>(r.slices[i].retries) / w << '\n';
    }
    d << "\n\n# " << r.policy << ": capacity (requests/s) from each time on\n";
    for (std::size_t i = 0; i < r.capacity.size(); ++i) {
      d << w * static_cast<double>(i) << ' ' << r.capacity[i] << '\n';
    }
    if (!r.capacity.empty()) {
      d << w * static_cast<double>(r.capacity.size()) << ' ' << r.capacity.back() << '\n';
    }
    d << "\n\n";
  }
  return d.str();
}

std::string plot_script(const std::vector<sim::Report>& reports, const std::string& data_path,
                        const std::string& out_path) {
  double load_max = 1;
  double capacity_max = 0;
  double xmax = 1;
  for (const auto& r : reports) {
    const double w = seconds(r.slice);
    for (const auto& s : r.slices)
      load_max = std::max(load_max, static_cast<double>(s.offered) / w);
    for (double c : r.capacity) capacity_max = std::max(capacity_max, c);
    xmax = std::max(xmax, seconds(r.slice * static_cast<std::int64_t>(r.slices.size())));
  }
  // The capacity line sets the scale too, unless it is far above every load (then the bars would
  // be flat: the line is left off the scale and its value stays in the legend).
  const bool capacity_on_scale = capacity_max > 0 && capacity_max <= 4 * load_max;
  const double ymax = (capacity_on_scale ? std::max(load_max, capacity_max) : load_max) * 1.15;
  const std::size_t n = reports.size();
  const int height = static_cast<int>(std::max<std::size_t>(1, n) * 230 + 50);
  std::ostringstream g;
  if (ends_with(out_path, ".svg")) {
    g << "set terminal svg size 1100," << height << " dynamic font 'sans,11' background 'white'\n";
  } else {
    g << "set terminal pngcairo size 1100," << height << " font 'sans,10'\n";
  }
  g << "set output " << quoted(out_path) << "\n";
  const std::string scenario = reports.empty() ? "" : reports[0].scenario;
  const std::string seed = reports.empty() ? "" : std::to_string(reports[0].seed);
  const std::string slice =
      reports.empty()
          ? ""
          : std::to_string(static_cast<long long>(seconds(reports[0].slice) * 1000)) + " ms";
  g << "set multiplot layout " << std::max<std::size_t>(1, n) << ",1 title "
    << quoted("keel sim: " + scenario + " (seed " + seed +
              "): attempts per second sent to the dependency, per " + slice + " slice" +
              (capacity_max > 0 ? ", against its capacity" : ""))
    << "\n";
  g << "set xrange [0:" << xmax << "]\nset yrange [0:" << ymax << "]\n";
  g << "set grid ytics\nset style fill solid 0.75 noborder\n";
  g << "set key outside right top vertical Left reverse samplen 2\n";
  // The legend sits right of the panels: room for its longest title.
  const std::string capacity_title = "CAPACITY " +
                                     std::to_string(static_cast<long long>(capacity_max)) + "/s" +
                                     (capacity_on_scale ? "" : " (off scale)");
  const std::size_t key_width = std::max<std::size_t>(std::string("attempts/s (all)").size(),
                                                      capacity_max > 0 ? capacity_title.size() : 0);
  g << "set lmargin 11\nset rmargin " << key_width + 8 << "\nset tmargin 2.5\n";
  g << "set ylabel 'attempts/s'\nset xlabel 'time (s)' offset 0,0.4\n";
  // The phases, shaded behind the bars and named at the top of every panel.
  if (!reports.empty()) {
    int id = 1;
    for (const auto& p : reports[0].phases) {
      const double x0 = seconds(p.span.start);
      const double x1 = std::min(xmax, seconds(p.span.end));
      std::string colour = "#f3f3f3";  // a phase after a trigger, and any other
      if (p.label == "steady") colour = "#e9f5e9";
      if (p.label == "blip") colour = "#ffe2a0";
      if (p.label == "outage") colour = "#f7c6c6";
      g << "set object " << id << " rect from first " << x0 << ", graph 0 to first " << x1
        << ", graph 1 behind fillcolor rgb '" << colour << "' fillstyle solid 1.0 noborder\n";
      g << "set label " << id << " " << quoted(p.label) << " at first " << (x0 + x1) / 2
        << ", graph 0.93 center front font ',10'\n";
      ++id;
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto& r = reports[i];
    g << "set title " << quoted("policy: " + r.policy) << " offset 0,-0.4\n";
    g << "plot " << quoted(data_path) << " index " << 2 * i
      << " using 1:2 with boxes lc rgb '#4477aa' title 'attempts/s (all)', '' index " << 2 * i
      << " using 1:3 with boxes lc rgb '#cc3311' title 'retries/s'";
    if (!r.capacity.empty()) {
      g << ", '' index " << 2 * i + 1 << " using 1:2 with steps lw 2.5 lc rgb '#111111' title "
        << quoted(capacity_title);
    }
    g << "\n";
  }
  g << "unset multiplot\n";
  return g.str();
}

namespace {

// Writes `content` to the file at `path` (in render_plot's temporary directory); false when it
// cannot be opened.
bool write_temporary(const std::string& path, const std::string& content) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  std::fwrite(content.data(), 1, content.size(), f);
  std::fclose(f);
  return true;
}

}  // namespace

bool render_plot(const std::vector<sim::Report>& reports, const std::string& path,
                 std::string& error) {
  if (!plot_format_supported(path)) {
    error = "'" + path + "' must end in .svg or .png";
    return false;
  }
  char dir_template[] = "/tmp/keel-plot-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) {
    error = "cannot create a temporary directory";
    return false;
  }
  const std::string data = std::string(dir) + "/series.dat";
  const std::string script_path = std::string(dir) + "/plot.gp";
  const std::string ext = ends_with(path, ".svg") ? ".svg" : ".png";
  const std::string tmp_out = std::string(dir) + "/out" + ext;
  auto cleanup = [&] {
    std::remove(data.c_str());
    std::remove(script_path.c_str());
    std::remove(tmp_out.c_str());
    rmdir(dir);
  };
  if (!write_temporary(data, plot_data(reports)) ||
      !write_temporary(script_path, plot_script(reports, data, tmp_out))) {
    error = "cannot write a temporary file";
    cleanup();
    return false;
  }
  // The child inherits stdio buffers: flush them, or what the parent printed is printed twice.
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    error = "cannot start gnuplot";
    cleanup();
    return false;
  }
  if (pid == 0) {
    std::freopen("/dev/null", "w", stdout);
    execlp("gnuplot", "gnuplot", script_path.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    error = WIFEXITED(status) && WEXITSTATUS(status) == 127
                ? "gnuplot is not installed (scripts/bootstrap.sh installs gnuplot-nox)"
                : "gnuplot failed to render the plot";
    cleanup();
    return false;
  }
  // Copy into place via a sibling temporary, then rename: never a partial output file.
  std::FILE* in = std::fopen(tmp_out.c_str(), "rb");
  const std::string sibling = path + ".tmp";
  std::FILE* out = in != nullptr ? std::fopen(sibling.c_str(), "wb") : nullptr;
  bool ok = in != nullptr && out != nullptr;
  if (ok) {
    char buf[65536];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, in)) > 0) {
      if (std::fwrite(buf, 1, n, out) != n) ok = false;
    }
  }
  if (in != nullptr) std::fclose(in);
  if (out != nullptr && std::fclose(out) != 0) ok = false;
  if (ok && std::rename(sibling.c_str(), path.c_str()) != 0) ok = false;
  if (!ok) {
    std::remove(sibling.c_str());
    error = "cannot write '" + path + "'";
  }
  cleanup();
  return ok;
}

}  // namespace keel::cli
