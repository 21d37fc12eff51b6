// getCreators: the library's plugin creators for IPluginRegistry::loadLibrary (setLoggerFinder,
// the other required entry point, is in logger.cpp). One line per op.
#include "common/plugin_common.h"

#include "maw_depth_gather/maw_depth_gather_plugin.h"
#include "maw_depth_select/maw_depth_select_plugin.h"
#include "tta_distance/tta_distance_plugin.h"

extern "C" ATTNX_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static attnx::plugin::MawDepthSelectCreator mawSelectCreator;
    static attnx::plugin::TtaDistanceCreator ttaCreator;
    static attnx::plugin::MawDepthGatherCreator mawGatherCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&mawSelectCreator, &ttaCreator, &mawGatherCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}
