// Logging glue of the attnx plugins: messages go to the ILogger of the TensorRT library that
// loaded us (handed over through setLoggerFinder), errors are also kept for
// attnx_plugins_errors() (attnx.plugins.plugin_errors), and stderr is the last resort.
#ifndef ATTNX_PLUGIN_LOGGER_H
#define ATTNX_PLUGIN_LOGGER_H

#include <NvInferRuntime.h>

#include <string>

namespace attnx
{
namespace plugin
{

//! Log through TensorRT's logger (stderr when TensorRT gave none).
void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

//! The kept error messages (newest last, one per line), and forgetting them.
std::string keptErrors();
void clearKeptErrors();

} // namespace plugin
} // namespace attnx

#endif // ATTNX_PLUGIN_LOGGER_H
