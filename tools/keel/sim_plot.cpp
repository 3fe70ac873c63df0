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

std::string plot_script(const std::vector<sim::Report>& reports, const std::string& data_path,
                        const std::string& out_path) {
  std::int64_t ymax = 1;
  double xmax = 1;
  for (const auto& r : reports) {
    for (const auto& s : r.slices) ymax = std::max(ymax, s.offered);
    xmax = std::max(xmax, seconds(r.slice * static_cast<std::int64_t>(r.slices.size())));
  }
  const std::size_t n = reports.size();
  const int height = static_cast<int>(std::max<std::size_t>(1, n) * 190 + 40);
  std::ostringstream g;
  if (ends_with(out_path, ".svg")) {
    g << "set terminal svg size 960," << height << " dynamic font 'sans,11' background 'white'\n";
  } else {
    g << "set terminal pngcairo size 960," << height << " font 'sans,10'\n";
  }
  g << "set output " << quoted(out_path) << "\n";
  const std::string scenario = reports.empty() ? "" : reports[0].scenario;
  const std::string slice =
      reports.empty()
          ? ""
          : std::to_string(static_cast<long long>(seconds(reports[0].slice) * 1000)) + " ms";
  g << "set multiplot layout " << std::max<std::size_t>(1, n) << ",1 title "
    << quoted("keel sim: " + scenario + " (calls per " + slice + " slice)") << "\n";
  g << "set xrange [0:" << xmax << "]\nset yrange [0:" << static_cast<double>(ymax) * 1.1 << "]\n";
  g << "set grid ytics\nset key top right\nset style fill solid 0.35 noborder\n";
  g << "set lmargin 10\nset rmargin 3\n";
  for (std::size_t i = 0; i < n; ++i) {
    const auto& r = reports[i];
    g << "set title " << quoted(r.policy) << " offset 0,-0.6\n";
    g << "set ylabel 'calls'\n";
    if (i + 1 == n) {
      g << "set xlabel 'time (s)'\n";
    } else {
      g << "unset xlabel\n";
    }
    g << "plot " << quoted(data_path) << " index " << i
      << " using 1:2 with boxes lc rgb '#4477aa' title 'all calls', '' index " << i
      << " using 1:3 with boxes lc rgb '#cc3311' title 'retries'\n";
  }
  g << "unset multiplot\n";
  return g.str();
}

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
  {
    std::FILE* f = std::fopen(data.c_str(), "w");
    if (f == nullptr) {
      error = "cannot write a temporary file";
      cleanup();
      return false;
    }
    for (const auto& r : reports) {
      std::fprintf(f, "# %s\n", r.policy.c_str());
      const double w = seconds(r.slice);
      for (std::size_t i = 0; i < r.slices.size(); ++i) {
        std::fprintf(f, "%.6f %lld %lld\n", w * (static_cast<double>(i) + 0.5),
                     static_cast<long long>(r.slices[i].offered),
                     static_cast<long long>(r.slices[i].retries));
      }
      std::fprintf(f, "\n\n");
    }
    std::fclose(f);
  }
  {
    std::FILE* f = std::fopen(script_path.c_str(), "w");
    if (f == nullptr) {
      error = "cannot write a temporary file";
      cleanup();
      return false;
    }
    const std::string script = plot_script(reports, data, tmp_out);
    std::fwrite(script.data(), 1, script.size(), f);
    std::fclose(f);
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
